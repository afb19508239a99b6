"""The adapters a front end has checked and an engine has read, by LoRARequest key (least recently used out).

`check` is what every front end runs before a request goes anywhere (the request's type, that the engine has
LoRA on, the adapter's config and tensor headers against the model: adapter.check_adapter); `load` reads the
weights too, once per adapter while it stays among the max_cpu_loras most recently used.
"""

from __future__ import annotations

from collections import OrderedDict

from .adapter import AdapterSpec, LoadedAdapter, check_adapter, read_adapter
from .request import LoRARequest

CHECKED = 256  # adapter checks remembered (headers only: small)


class AdapterCache:
    def __init__(self, config):
        self.enabled = config.enable_lora
        self.model_config = config.model_config
        self.max_rank = config.max_lora_rank
        self.capacity = config.max_cpu_loras or config.max_loras
        self._checked: OrderedDict[tuple, AdapterSpec] = OrderedDict()
        self._loaded: OrderedDict[tuple, LoadedAdapter] = OrderedDict()

    def check(self, lora) -> AdapterSpec:
        """ValueError / TypeError naming lora_request (and the adapter's file and field)."""
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a graphdecode.LoRARequest, got {type(lora).__name__}")
        if not self.enabled:
            raise ValueError(f"lora_request: adapter {lora.lora_name!r} given, but the engine was started without "
                             f"enable_lora=True")
        spec = self._checked.get(lora.key)
        if spec is None:
            try:
                spec = check_adapter(lora.lora_path, self.model_config, self.max_rank)
            except ValueError as e:
                raise ValueError(f"lora_request ({lora.lora_name!r}): {e}") from None
            self._checked[lora.key] = spec
            while len(self._checked) > CHECKED:
                self._checked.popitem(last=False)
        self._checked.move_to_end(lora.key)
        return spec

    def load(self, lora) -> LoadedAdapter:
        """The adapter checked and read (from memory when it is among the most recently used)."""
        spec = self.check(lora)
        loaded = self._loaded.get(lora.key)
        if loaded is None:
            try:
                loaded = LoadedAdapter(spec, tuple(read_adapter(spec)))
            except ValueError as e:
                raise ValueError(f"lora_request ({lora.lora_name!r}): {e}") from None
            except OSError as e:
                self._checked.pop(lora.key, None)
                raise ValueError(f"lora_request ({lora.lora_name!r}): {spec.weight_file} cannot be read ({e})") \
                    from None
            self._loaded[lora.key] = loaded
            while len(self._loaded) > self.capacity:
                self._loaded.popitem(last=False)
        self._loaded.move_to_end(lora.key)
        return loaded

    def forget(self, lora) -> None:
        """Drop what is remembered of an adapter (its files may change: a server's unload)."""
        self._checked.pop(lora.key, None)
        self._loaded.pop(lora.key, None)
