"""The engine through LLM on a CPU: parity, scheduling, outputs and the offline API's semantics."""
