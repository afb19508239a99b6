"""graphdecode: a CUDA-graph-centric LLM decode engine (the GPU never waits for Python)."""

from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .runtime.llm import LLM
from .sampling_params import RequestOutputKind, SamplingParams
from .structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestMetrics", "RequestOutputKind"]
__version__ = "0.1.0"
