"""The runner and the device-side pieces, on a CPU: staging, the graph twin, bounds, compile, FlashInfer dry runs."""
