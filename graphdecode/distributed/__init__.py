"""Tensor parallelism over torch.distributed: the driver's executor and the worker ranks."""
