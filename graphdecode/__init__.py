"""graphdecode: a CUDA-graph-centric LLM decode engine (the GPU never waits for Python).

The public names load on first use (PEP 562), so a process that needs only a light part of
the package (the structured-outputs compile worker) does not import torch.
"""

import importlib

_PUBLIC = {
    "LLM": ".host.llm",
    "SamplingParams": ".sampling_params",
    "RequestOutputKind": ".sampling_params",
    "StructuredOutputsParams": ".structured.params",
    "RequestOutput": ".outputs",
    "CompletionOutput": ".outputs",
    "Logprob": ".outputs",
    "RequestMetrics": ".outputs",
    "LoRARequest": ".lora.request",
}

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestMetrics", "RequestOutputKind", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'graphdecode' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_PUBLIC))
