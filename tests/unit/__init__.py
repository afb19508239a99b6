"""Pure functions: parameters, configs and checkpoints checked by name, sampling, automata, units."""
