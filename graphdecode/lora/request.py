"""LoRARequest: the adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`, the same fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's name (what a server's `model` field selects); lora_int_id: its id, >= 1, unique per
    adapter (two requests with the same id run the same adapter and share prefix-cache pages); lora_path: the PEFT
    adapter's directory (adapter_config.json and adapter_model.safetensors). base_model_name: the model the adapter
    was trained on, reported by a server's /v1/models (optional)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got {self.lora_name!r:.200}")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or not 1 <= self.lora_int_id < 1 << 63):  # KV-cache events carry it as an int64 (vLLM's lora_id)
            raise ValueError(f"lora_request.lora_int_id must be an integer in [1, 2**63), got {self.lora_int_id!r:.200}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path must be the adapter's directory, got {self.lora_path!r:.200}")

    @property
    def key(self) -> tuple[int, str]:
        """What identifies the adapter's weights: its id and directory."""
        return self.lora_int_id, self.lora_path
