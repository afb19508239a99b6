"""LoRA adapters (vLLM's multi-LoRA): PEFT checkpoints applied per request, several in one batch.

`LoRARequest` names an adapter a request runs with (request.py); the engine reads its PEFT files once
(adapter.py), the scheduler keeps at most `max_loras` adapters resident in device slots
(host/lora_slots.py), and the model's projections add each row's own adapter through one masked pair of
matmuls over every slot (layers.py, model.py). docs/lora.md says what runs and what it costs.
"""

from .request import LoRARequest

__all__ = ["LoRARequest"]
