"""LLM: the Python front end (vLLM-shaped): generate, stream, stats."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from ..config import EngineConfig
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .engine import Engine
from .output_builder import delta_outputs, final_output
from .sequence import Request


@contextlib.contextmanager
def _cyclic_gc_paused():
    """No cyclic garbage collection during a generate() call.

    Every full collection walks every live object, and a large offline batch keeps
    hundreds of thousands of requests alive: measured at 100k prompts, the collector
    took 6% of the run (profiling/bench_scale.py --gc). The requests stay alive until
    the call returns anyway; what is left over is collected after it, as usual.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        """`model`: a HuggingFace model directory (default: the built-in random Llama).

        `engine_args` are EngineConfig's fields (device, dtype, max_batch_size, buckets,
        num_decode_steps, page_size, num_pages, max_model_len, attention_backend, compile,
        cuda_graphs, seed, ...); their defaults and validation live there, once.
        """
        if model is None:
            from ..default_model import default_model_dir

            model = default_model_dir()
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = Engine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order."""
        with _cyclic_gc_paused():
            requests = self._add(prompts, sampling_params)
            while self.engine.has_unfinished():
                self.engine.step()
            return [final_output(r) for r in requests]

    def stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield RequestOutput deltas as windows are pythonized (at most one per sequence per window).

        Closing the iterator early aborts the requests it started.
        """
        requests = self._add(prompts, sampling_params)
        mine = {r.request_id for r in requests}
        try:
            while self.engine.has_unfinished():
                for out in delta_outputs(self.engine.step()):
                    if out.request_id in mine:
                        yield out
        finally:
            for r in requests:
                if not r.finished:
                    self.engine.abort_request(r.request_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.engine.abort_request(request_id)
        return final_output(request) if request is not None else None

    def stats(self) -> dict:
        return self.engine.stats()

    def _add(self, prompts, sampling_params) -> list[Request]:
        """Validate every prompt first; only then add them all (a bad one adds nothing)."""
        single = isinstance(prompts, (str, dict))
        prompt_list = [prompts] if single else list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: {len(sampling_params)} given for {len(prompt_list)} prompts"
                )
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params if sampling_params is not None else SamplingParams()] * len(prompt_list)
        parsed = self.engine.inputs.tokenize_all(prompt_list)
        requests = [
            self.engine.prepare(text, ids, params)
            for (text, ids), params in zip(parsed, params_list)
        ]
        for request in requests:
            self.engine.add_prepared(request)
        return requests
