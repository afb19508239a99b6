"""What is compiled or captured: the decode window and its CUDA graphs per bucket, torch.compile
of the forward, the on-device sampler, and the advance_step op (torch reference + CUDA build/loader)."""
