"""The kernels' CPU paths and builds: CPU attention, fused passes and linears, csrc, advance_step on the host."""
