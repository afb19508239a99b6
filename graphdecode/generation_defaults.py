"""The sampling defaults a model's authors recommend: generation_config.json, applied as vLLM applies them.

Checkpoints carry their authors' sampling settings in generation_config.json (Qwen3: temperature 0.6,
top_p 0.95, top_k 20; Llama 3.1: temperature 0.6, top_p 0.9). With vLLM's default `generation_config="auto"`,
every request that does not set a field gets the file's value instead of SamplingParams' neutral default:

* the fields read are vLLM's: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, and
  `max_new_tokens` (as `max_tokens`); anything else in the file (`do_sample`, `eos_token_id`, ...) is not a
  sampling default. As in vLLM, `do_sample: false` does not turn a recommended temperature into greedy
  decoding: ask for `temperature=0`, or `generation_config="vllm"`.
* `LLM.generate` / `chat` / `stream` and `AsyncLLM.generate` called with no SamplingParams (or None for a
  prompt) build one from the defaults (`LLM.get_default_sampling_params()`); a SamplingParams the caller
  built is used exactly as built.
* the servers (OpenAI, Anthropic Messages, Responses) fill each field a request leaves out; the recommended
  `max_tokens` also caps what a request asks for (vLLM's rule: the smaller of the two).
* `generation_config="vllm"` ignores the file (SamplingParams' neutral defaults); a directory reads its
  generation_config.json instead of the model's. `override_generation_config` ({"temperature": 0.5, ...},
  HuggingFace's names) is laid over either; a null value removes that field's default.

Every value is checked when the engine is configured, before a weight is read: a bad one is a ValueError naming
the file (or override_generation_config) and the field.
"""

from __future__ import annotations

import os

from .models.config_fields import read_json_object
from .sampling_params import SamplingParams

# generation_config.json's names of the sampling defaults vLLM reads -> SamplingParams' names
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_dir: str, generation_config: str = "auto",
                      override_generation_config: dict | None = None) -> dict:
    """SamplingParams keyword arguments: the recommended defaults, checked (vLLM's get_diff_sampling_param)."""
    if not isinstance(generation_config, (str, os.PathLike)):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding a "
                         f"generation_config.json, got {generation_config!r}")
    generation_config = os.fspath(generation_config)
    recommended: dict = {}
    if generation_config != "vllm":
        directory = model_dir if generation_config == "auto" else generation_config
        path = os.path.join(directory, "generation_config.json")
        if os.path.isfile(path):
            raw = read_json_object(path)
            recommended = {name: raw[name] for name in SAMPLING_FIELDS if name in raw}
            _check(recommended, path)
        elif generation_config != "auto":
            raise ValueError(f"generation_config: {generation_config!r} is not a directory holding a "
                             f"generation_config.json (or 'auto' for the model's, 'vllm' for none)")
    override = {} if override_generation_config is None else override_generation_config
    if not isinstance(override, dict):
        raise ValueError(f"override_generation_config must be a dict of generation_config.json fields, "
                         f"got {override!r}")
    unknown = [name for name in override if name not in SAMPLING_FIELDS]
    if unknown:
        raise ValueError(f"override_generation_config: {unknown[0]!r} is not a sampling default (those read: "
                         f"{', '.join(SAMPLING_FIELDS)})")
    _check(override, "override_generation_config")
    merged = {**recommended, **override}
    return {SAMPLING_FIELDS[name]: value for name, value in merged.items() if value is not None}


def _check(fields: dict, where: str) -> None:
    """Each value as SamplingParams would take it; the error names `where` and the file's own field name."""
    for name, value in fields.items():
        if value is None:
            continue
        try:
            SamplingParams(**{SAMPLING_FIELDS[name]: value})
        except (ValueError, TypeError) as e:
            message = str(e)
            if name != SAMPLING_FIELDS[name]:
                message = message.replace(SAMPLING_FIELDS[name], name, 1)
            raise ValueError(f"{where}: {message}") from None


def capped_max_tokens(defaults: dict, requested: int | None) -> int | None:
    """vLLM's rule for the servers: the recommended max_tokens caps what a request asks for (None: no limit)."""
    cap = defaults.get("max_tokens")
    if cap is None:
        return requested
    return cap if requested is None else min(requested, cap)
