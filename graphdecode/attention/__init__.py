"""Paged KV cache, attention metadata and backends (torch reference, FlashInfer)."""

from .backend import AttentionBackend, ForwardContext
from .metadata import DecodeMetadata, PrefillMetadata, VerifyMetadata
from .torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "ForwardContext", "DecodeMetadata", "PrefillMetadata", "VerifyMetadata",
           "TorchAttentionBackend"]
