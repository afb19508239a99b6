"""EngineConfig's LoRA fields checked: what a LoRA engine runs, and what it refuses by name."""

from __future__ import annotations

MAX_LORA_RANK = 512  # vLLM's largest


def lora_buffer_bytes(cfg, dtype, max_loras: int, max_rank: int) -> int:
    """Bytes of a LoRA engine's A and B buffers (lora/layers.py): per layer and projection, max_loras x shards x rank
    columns of its inputs and of its outputs (a CPU's panels hold a second copy: the pool sizing counts weights
    twice there)."""
    import torch

    from .adapter import GROUPS, module_shapes

    per_layer = sum(max_loras * GROUPS[module] * max_rank * (k + n) for module, (k, n) in module_shapes(cfg).items())
    return per_layer * cfg.decoder_layers * torch.empty(0, dtype=dtype).element_size()


def check_lora_config(config, cfg, family, device) -> None:
    """ValueError naming the field: enable_lora, max_loras, max_lora_rank, max_cpu_loras, and the features a LoRA
    engine does not combine with yet."""
    if not isinstance(config.enable_lora, bool):
        raise ValueError(f"enable_lora must be True or False, got {config.enable_lora!r}")
    for name in ("max_loras", "max_lora_rank"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if config.max_lora_rank > MAX_LORA_RANK:
        raise ValueError(f"max_lora_rank must be <= {MAX_LORA_RANK}, got {config.max_lora_rank}")
    cpu_loras = config.max_cpu_loras
    if cpu_loras is not None and (isinstance(cpu_loras, bool) or not isinstance(cpu_loras, int)
                                  or cpu_loras < config.max_loras):
        raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({config.max_loras}), got {cpu_loras!r}")
    if not config.enable_lora:
        return
    from ..models.decoder import DecoderForCausalLM

    refusals = (
        (config.speculative_config is not None, "speculative_config"),
        (config.tensor_parallel_size > 1, "tensor_parallel_size > 1"),
        (config.pipeline_parallel_size > 1, "pipeline_parallel_size > 1"),
        (config.compile is True, "compile=True (a LoRA engine runs the eager forward, in graphs where they run)"),
        (cfg.moe is not None, f"a mixture-of-experts model ({cfg.model_type})"),
        (cfg.mla is not None, f"latent attention ({cfg.model_type})"),
        (cfg.linear is not None, f"a hybrid model ({cfg.model_type})"),
        (cfg.attn_output_gate, f"gated attention ({cfg.model_type})"),
        (not (issubclass(family, DecoderForCausalLM) and family.plain_layer_loop(cfg)),
         f"{family.__name__}, which runs a layer loop of its own"),
    )
    for refused, what in refusals:
        if refused:
            raise ValueError(f"enable_lora: LoRA adapters do not run with {what} yet")
