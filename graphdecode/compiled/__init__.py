"""The model as plain nn.Modules, weight loading, sampler, advance_step and the decode-window graphs."""
