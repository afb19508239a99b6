"""Writing EAGLE-3 heads in the published checkpoint format (models/eagle3.py reads it): the distillation
script's trained heads (profiling/distil_eagle3.py) and random heads for tests and the GPU check."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from .model_config import load_model_config


def head_config(target_dir: str, *, draft_vocab_size: int, aux_layers: tuple[int, ...] | None = None,
                intermediate_size: int | None = None) -> dict:
    """config.json of a head for the target in `target_dir`: its hidden size, heads, rope and vocabulary."""
    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    cfg = load_model_config(target_dir)
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
            "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "hidden_act",
            "bos_token_id", "eos_token_id")
    out = {k: target[k] for k in keep if k in target}
    if isinstance(out.get("rope_parameters"), dict):  # a Llama layer rotates whole heads (Qwen3.5's are partial)
        out["rope_parameters"] = {k: v for k, v in out["rope_parameters"].items()
                                  if k not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")}
    out.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
               intermediate_size=intermediate_size or cfg.intermediate_size, tie_word_embeddings=False,
               draft_vocab_size=draft_vocab_size, target_hidden_size=cfg.hidden_size, torch_dtype="float32")
    if aux_layers is not None:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True}
    return out


def save_eagle3_head(path: str, config: dict, tensors: dict[str, torch.Tensor],
                     draft_ids: torch.Tensor | None = None) -> str:
    """config.json and model.safetensors: `tensors` by the checkpoint's names (fc, midlayer.*, norm, lm_head,
    optionally embed_tokens); `draft_ids` [draft_vocab] the target id of each draft id (ascending), stored as
    d2t offsets and a t2d mask."""
    os.makedirs(path, exist_ok=True)
    out = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    if draft_ids is not None:
        draft_ids = draft_ids.to(torch.int64).cpu()
        out["d2t"] = draft_ids - torch.arange(draft_ids.numel())
        t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
        t2d[draft_ids] = True
        out["t2d"] = t2d
    save_file(out, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def random_eagle3_head(path: str, target_dir: str, *, draft_vocab_size: int, aux_layers: tuple[int, ...] | None = None,
                       own_embedding: bool = False, std: float = 0.1, seed: int = 0) -> str:
    """A head of random weights (normal, `std`) over a random draft vocabulary of `draft_vocab_size` ids."""
    config = head_config(target_dir, draft_vocab_size=draft_vocab_size, aux_layers=aux_layers)
    g = torch.Generator().manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "midlayer.input_layernorm.weight": 1 + rand(hidden),
        "midlayer.hidden_norm.weight": 1 + rand(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden),
        "norm.weight": 1 + rand(hidden),
        "lm_head.weight": rand(draft_vocab_size, hidden),
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, hidden)
    draft_ids = None
    if draft_vocab_size < vocab:
        draft_ids = torch.randperm(vocab, generator=g)[:draft_vocab_size].sort().values
    return save_eagle3_head(path, config, tensors, draft_ids)
