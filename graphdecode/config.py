"""EngineConfig: the one frozen configuration, validated and resolved in __post_init__.

The user-facing fields mirror `LLM(...)`'s arguments. `__post_init__` checks each one
(a ValueError names the field), reads the model's config.json, and fills the
resolved fields (device, dtype, max_model_len, num_pages, buckets, ...) that the
rest of the engine reads, so there is exactly one place defaults are decided.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field

import torch

from .attention.kv_cache import FP8, kv_bytes_per_page
from .attention.state_cache import slot_bytes
from .generation_defaults import sampling_defaults
from .launcher import DEFAULT_MASTER_PORT, launcher_env
from .lora.config import check_lora_config, lora_buffer_bytes
from .models.config_fields import INT_MAX
from .models.eagle3 import Eagle3Config, read_eagle3_config
from .models.model_config import ModelConfig, load_model_config
from .models.mtp import MTPConfig, read_mtp_config
from .models.pipeline import partition_layers
from .models.registry import model_class

_DTYPE_NAMES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "half": torch.float16,  # vLLM's names
    "float": torch.float32,
}
DEFAULT_MAX_BATCH_SIZE = 256
MAX_ROWS = 1024  # advance_step scans all rows of a bucket in one CUDA block
ATTENTION_BACKENDS = ("torch", "flashinfer")
CPU_KV_BUDGET_BYTES = 2 << 30  # a CPU engine's KV pool when no size is given (at most what max_batch_size fills)
GPU_MEMORY_FRACTION = 0.85  # gpu_memory_utilization on CUDA when no size is given
ACTIVATION_RESERVE_BYTES = 2 << 30  # kept out of a gpu_memory_utilization budget for activations (per rank)
CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM-CPU's: GiB of KV pool per rank, a CPU engine's default
CPU_THREADS_ENV = "GRAPHDECODE_CPU_THREADS"  # cpu_threads when the argument is not given
TORCH_BACKEND_CUDA_MAX_LEN = 4096  # default cap for the torch reference attention on CUDA
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
SCHEDULING_POLICIES = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("mp", "external_launcher", "ray")

logger = logging.getLogger("graphdecode")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # a directory holds a tokenizer


KV_EVENTS_DEFAULTS = {"enable_kv_cache_events": False, "publisher": "null", "endpoint": "tcp://*:5557",
            "replay_endpoint": None, "buffer_steps": 10_000, "hwm": 100_000, "max_queue_size": 100_000, "topic": ""}
KV_EVENTS_PUBLISHERS = ("null", "zmq")
KV_EVENTS_TRANSPORTS = ("tcp://", "ipc://", "inproc://")


def _check_kv_events_config(given) -> dict | None:
    """kv_events_config with vLLM's defaults filled in (host/kv_events.py reads it), or None when events are off;
    ValueError naming the key."""
    if given is None:
        return None
    if not isinstance(given, dict):
        raise ValueError(f"kv_events_config must be a dict of vLLM's KVEventsConfig keys, got {given!r}")
    unknown = sorted(set(given) - set(KV_EVENTS_DEFAULTS))
    if unknown:
        raise ValueError(f"kv_events_config: unknown key {unknown[0]!r} (known: {', '.join(KV_EVENTS_DEFAULTS)})")
    config = {**KV_EVENTS_DEFAULTS, **given}
    if not isinstance(config["enable_kv_cache_events"], bool):
        raise ValueError(f"kv_events_config.enable_kv_cache_events must be true or false, got "
                         f"{config['enable_kv_cache_events']!r}")
    if config["publisher"] not in KV_EVENTS_PUBLISHERS:
        raise ValueError(f"kv_events_config.publisher must be one of {', '.join(KV_EVENTS_PUBLISHERS)}, got "
                         f"{config['publisher']!r}")
    for key in ("endpoint", "topic"):
        if not isinstance(config[key], str):
            raise ValueError(f"kv_events_config.{key} must be a string, got {config[key]!r}")
    if config["replay_endpoint"] is not None and not isinstance(config["replay_endpoint"], str):
        raise ValueError(f"kv_events_config.replay_endpoint must be a string or null, got "
                         f"{config['replay_endpoint']!r}")
    for key in ("endpoint", "replay_endpoint"):  # ZMQ's transports (a bad one would fail only once bound)
        if config[key] is not None and not config[key].startswith(KV_EVENTS_TRANSPORTS):
            raise ValueError(f"kv_events_config.{key} must be a ZMQ endpoint ({', '.join(KV_EVENTS_TRANSPORTS)}...), "
                             f"got {config[key][:200]!r}")
    for key in ("buffer_steps", "hwm", "max_queue_size"):  # ZMQ's high-water mark is a C int
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT_MAX:
            raise ValueError(f"kv_events_config.{key} must be an integer in [1, {INT_MAX}], got {value!r}")
    if not config["enable_kv_cache_events"] or config["publisher"] == "null":
        return None
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise ValueError(f"kv_events_config: publishing KV events needs pyzmq and msgspec ({e}); "
                         f"pip install pyzmq msgspec (graphdecode's [kv-events] extra)") from None
    return config


def _pos_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: taskset, cgroup cpusets), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this platform
        return os.cpu_count() or 1


def _resolve_cpu_threads(given, ranks_here: int) -> int:
    """cpu_threads as given; else GRAPHDECODE_CPU_THREADS; else the usable cores, shared among this machine's ranks."""
    if given is not None:
        _pos_int("cpu_threads", given)
        return given
    text = os.environ.get(CPU_THREADS_ENV, "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"cpu_threads: {CPU_THREADS_ENV} must be a positive integer, got {text!r}")
        return int(text)
    return max(1, usable_cores() // ranks_here)


def _env_kvcache_bytes() -> int | None:
    """VLLM_CPU_KVCACHE_SPACE (GiB, as vLLM-CPU reads it) in bytes; None when unset, empty or 0 (vLLM's: auto)."""
    text = os.environ.get(CPU_KVCACHE_SPACE_ENV, "").strip()
    if not text:
        return None
    try:
        gib = float(text)
    except ValueError:
        gib = -1.0
    if not 0 <= gib < 1 << 20:  # also NaN
        raise ValueError(f"kv_cache_memory_bytes: {CPU_KVCACHE_SPACE_ENV} must be a number of GiB >= 0, got {text!r}")
    return int(gib * (1 << 30)) or None


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host RAM: /proc/meminfo's MemAvailable and MemTotal where there is one."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _device_memory(device: torch.device) -> int:
    """The device's memory in bytes: the GPU's, or the host's RAM."""
    return torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else _host_memory()[1]


def _default_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Powers of two below max_batch_size, then max_batch_size itself."""
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i < max_batch_size]
    return tuple(sizes) + (max_batch_size,)


def _check_buckets(buckets) -> tuple[int, ...]:
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, (list, tuple)) or not buckets:
        raise ValueError(f"buckets must be a non-empty list of batch sizes, got {buckets!r}")
    for b in buckets:
        _pos_int("buckets", b)
    if any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"buckets must be strictly increasing, got {list(buckets)!r}")
    if buckets[-1] > MAX_ROWS:
        raise ValueError(f"buckets: the largest bucket must be <= {MAX_ROWS}, got {buckets[-1]}")
    return tuple(buckets)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str | None = None
    dtype: str | torch.dtype | None = None
    max_batch_size: int | None = None  # default DEFAULT_MAX_BATCH_SIZE, or the largest explicit bucket
    buckets: tuple[int, ...] | list[int] | None = None  # padded batch sizes that get a graph
    num_decode_steps: int = 8
    page_size: int = 16
    # The KV pool (one per tensor-parallel rank), vLLM's three ways to size it; give at most one:
    # num_pages: its pages, exactly (vLLM's num_gpu_blocks_override);
    # kv_cache_memory_bytes: its bytes per rank, on either device: num_pages = this // bytes per page;
    # gpu_memory_utilization: the share (0, 1] of the device's memory the engine may take, weights, pool and an
    #   activation reserve together, after what others use now: the GPU's memory on CUDA, the host's RAM
    #   (MemTotal, MemAvailable) on CPU, where the ranks of one engine share it.
    # None of them: on CUDA, gpu_memory_utilization GPU_MEMORY_FRACTION; on CPU, VLLM_CPU_KVCACHE_SPACE GiB when
    # set, else CPU_KV_BUDGET_BYTES. A fraction or the fixed CPU budget never takes more pages than
    # max_batch_size sequences of max_model_len fill; an explicit size that cannot hold one such sequence is a
    # ValueError naming it.
    num_pages: int | None = None
    kv_cache_memory_bytes: int | None = None
    # the KV cache's element (vLLM's name): "auto", the model's dtype; "fp8" (or "fp8_e4m3"), FP8 E4M3 at one byte
    # an element, each layer's K / V divided by the checkpoint's k_scale / v_scale (1.0 where it has none): a pool
    # of the same bytes holds 2x the tokens of bf16 (4x float32's)
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    attention_backend: str | None = None
    compile: bool | None = None
    cuda_graphs: bool | None = None
    seed: int = 0
    max_num_batched_tokens: int = 8192  # prefill tokens per engine step (longer prompts are chunked)
    enable_prefix_caching: bool = True
    # a request's tokens do not depend on the batch it runs in (CPU: every linear's rows through the fixed-order
    # panel kernel); False allows faster, batch-dependent kernels (--allow-batch-variance)
    batch_invariant: bool = True
    # a hybrid model's prefix cache keeps the recurrent state at up to this many cached page boundaries (each one
    # slot of the state cache, host/state_slots.py); None: max_batch_size of them (0 without prefix caching)
    num_state_snapshots: int | None = None
    # logprobs / prompt_logprobs per token a request may ask for (0: the sampled or prompt token's own only, as
    # vLLM's); -1: no cap, logprobs=-1 gives the whole vocabulary (the device's logprob buffers then hold
    # vocab_size entries per row and step)
    max_logprobs: int = 20
    # what logprobs report (vLLM's names): the model's log-softmax ("raw_logprobs") or logits
    # ("raw_logits"), or either after logit_bias, bad words, allowed_token_ids, penalties, min_tokens,
    # temperature and top-k/top-p/min-p ("processed_logprobs", "processed_logits")
    logprobs_mode: str = "raw_logprobs"
    # "fcfs": admission in arrival order; "priority": lowest `priority` value first (then arrival),
    # and preemption takes the lowest-priority work first
    scheduling_policy: str = "fcfs"
    # the device's table store for structured-outputs constraints (host/structured_store.py): automaton
    # states (each ceil(vocab_size / 32) * 4 bytes of mask: 6 KB at a 49k vocabulary) and transition
    # exceptions (8 bytes each: 64 MB at this default); allocated at the first constrained request. A
    # string with a maxLength costs about maxLength x vocabulary exceptions (each token length leads
    # elsewhere): SmolLM2, four bounded strings of 16-24 characters: 3.4 million
    structured_max_states: int = 4096
    structured_max_exceptions: int = 1 << 23
    # a constraint compiles in a worker process under these budgets (structured/budget.py): wall seconds, and
    # memory above the worker's baseline (2 GiB: two workers at most, well inside a 24 GiB machine); a compile
    # estimated above the memory budget is refused before it starts. Either way a ValueError / 400 names the field.
    structured_compile_timeout: float = 20.0
    structured_compile_memory_bytes: int = 2 << 30
    max_stop_ids: int = 16
    max_logit_bias: int = 64  # logit_bias entries per request (device buffers: [max_batch_size, this])
    max_bad_words: int = 16  # bad_words per request (each holds up to 2 token sequences on the device)
    max_bad_word_tokens: int = 8  # tokens per bad word
    tensor_parallel_size: int = 1  # ranks one model is split over (rank r on cuda:r, or CPU processes with gloo)
    # stages the decoder's layers are split over, each of tensor_parallel_size ranks (models/pipeline.py): global
    # rank r is stage r // tensor_parallel_size; on CPU ranks (gloo) so far
    pipeline_parallel_size: int = 1
    # decoder layers per stage (vLLM's VLLM_PP_LAYER_PARTITION), e.g. [10, 14] or "10,14"; None: an even split, the
    # remainder to the stages before the last
    pp_layer_partition: tuple[int, ...] | list[int] | str | None = None
    # micro-batches a decode window's rows are split into over pipeline stages, so the stages overlap
    # (device/pipeline_window.py): 1 runs one at a time (a stage idles while the others run); None:
    # pipeline_parallel_size of them (no stage idles in steady state); a bucket with fewer rows runs as one
    pp_micro_batches: int | None = None
    # how the ranks start (vLLM's names): "mp", this process spawns its machine's ranks (across nnodes machines,
    # the other nodes' ranks are started there by `graphdecode serve --headless`); "external_launcher", torchrun
    # (or another env:// launcher) started every rank, the process of RANK 0 is the engine and the others serve
    # it (device/launched.py); "ray", ranks 1..N-1 are actors on the Ray cluster (device/ray_ranks.py)
    distributed_executor_backend: str = "mp"
    nnodes: int = 1  # machines the ranks of "mp" span: world_size / nnodes ranks on each
    node_rank: int = 0  # this machine's index among them: node 0 runs the engine, the others are headless
    master_addr: str = "127.0.0.1"  # where node 0's rank 0 meets the other nodes' ranks (nnodes > 1)
    master_port: int | None = None  # its port; None: DEFAULT_MASTER_PORT across machines, a free one on one
    # KV-cache events for prefix-aware routers (vLLM's KVEventsConfig keys: enable_kv_cache_events, publisher
    # "zmq", endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic; host/kv_events.py); resolved to
    # the full dict, or None when off
    kv_events_config: dict | None = None
    data_parallel_rank: int = 0  # this engine's index among data-parallel replicas: tags its KV events
    # vLLM's names: {"method": "ngram", "num_speculative_tokens": d, "prompt_lookup_max": .., "prompt_lookup_min": ..}
    # or {"method": "draft_model" | "eagle3", "model": DIR, "num_speculative_tokens": d}, or {"method": "mtp",
    # "num_speculative_tokens": d} (the target's own MTP layer; "model" optional, the target's directory); None: off
    speculative_config: dict | None = None
    # LoRA adapters (vLLM's names; lora/, docs/lora.md): enable_lora lets a request name a PEFT adapter
    # (LoRARequest); max_loras: adapters resident on the device at once (a window's rows use at most this many; a
    # request whose adapter finds no free slot waits); max_lora_rank: the largest rank an adapter may have (the
    # device buffers' width, max_loras x max_lora_rank columns per projection shard, paid by every token);
    # max_cpu_loras: adapters kept read in host memory (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # the tokenizer's directory (vLLM's `tokenizer`): a model directory without one, or a tokenizer other than its
    # own (the same vocabulary); None: the model's
    tokenizer: str | None = None
    # the sampling defaults a request that leaves a field out gets (generation_defaults.py, vLLM's names): "auto",
    # the model's generation_config.json (its temperature, top_p, top_k, min_p, repetition_penalty,
    # max_new_tokens); "vllm", SamplingParams' neutral ones; or a directory holding a generation_config.json.
    # override_generation_config ({"temperature": 0.5, ...}, the file's names) is laid over it
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # torch's intra-op threads for a CPU engine (its process, and each CPU tensor-parallel rank). None: the
    # environment's GRAPHDECODE_CPU_THREADS, else the cores this process may use (os.sched_getaffinity),
    # divided among the tensor-parallel ranks; resolved to that number. On a busy machine give fewer: threads
    # beyond the idle cores make every small matmul wait for a descheduled thread (2 threads on a 2-core
    # machine with a busy neighbour: small matmuls up to 100x slower than 1, the API at 2 tok/s instead of 38).
    cpu_threads: int | None = None
    # a CPU engine's weights on 2 MiB pages: collapsed in place once loaded (models/huge_pages.py; Linux 6.1+,
    # elsewhere a no-op), in a thread beside the rest of start-up. Decode streams every weight, and on 4 KiB
    # pages every read misses the TLB: 8% faster at batch 1 on a 2-core Zen 4 (BENCHMARKS.md 18u)
    cpu_huge_pages: bool = True
    # the bounds-checked mode (device/bounds.py): every window step checks the indices its kernels follow
    # (positions, KV slots and lengths, automaton states); None: on when GRAPHDECODE_CHECK_BOUNDS=1
    check_bounds: bool | None = None

    # resolved in __post_init__
    model_config: ModelConfig = field(init=False, repr=False)
    torch_device: torch.device = field(init=False)
    torch_dtype: torch.dtype = field(init=False)
    kv_torch_dtype: torch.dtype = field(init=False)  # the KV cache's: torch_dtype, or float8_e4m3fn
    max_pages_per_seq: int = field(init=False)
    logprobs_width: int = field(init=False)  # logprob entries per row and step on the device
    num_speculative_tokens: int = field(init=False)  # d; 0 when speculative decoding is off
    speculative_method: str | None = field(init=False)  # "ngram", "draft_model", "eagle3" or "mtp"; None when off
    draft_model: str | None = field(init=False)  # the draft model's, EAGLE-3 head's or MTP layer's directory
    draft_model_config: ModelConfig | None = field(init=False, repr=False)  # its config.json
    eagle3_config: Eagle3Config | None = field(init=False, repr=False)  # the head's fields (method "eagle3")
    mtp_config: MTPConfig | None = field(init=False, repr=False)  # the target's MTP layer (method "mtp")
    prompt_lookup_max: int = field(init=False)
    prompt_lookup_min: int = field(init=False)
    # SamplingParams keyword arguments from generation_config / override_generation_config ({} when none)
    sampling_defaults: dict = field(init=False)

    def __post_init__(self):
        if not isinstance(self.model, (str, os.PathLike)) or not os.path.isdir(self.model):
            raise ValueError(f"model must be a HuggingFace model directory, got {self.model!r}")
        _pos_int("max_batch_size", self.max_batch_size, allow_none=True)
        if self.max_batch_size is not None and self.max_batch_size > MAX_ROWS:
            raise ValueError(f"max_batch_size must be <= {MAX_ROWS}, got {self.max_batch_size}")
        if self.buckets is None:
            max_batch_size = self.max_batch_size or DEFAULT_MAX_BATCH_SIZE
            buckets = _default_buckets(max_batch_size)
        else:
            buckets = _check_buckets(self.buckets)
            if self.max_batch_size is not None and buckets[-1] > self.max_batch_size:
                raise ValueError(
                    f"buckets: the largest bucket ({buckets[-1]}) exceeds max_batch_size ({self.max_batch_size})"
                )
            max_batch_size = buckets[-1]  # no more rows run than the largest graph holds
        _pos_int("num_decode_steps", self.num_decode_steps)
        _pos_int("page_size", self.page_size)
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        _pos_int("num_pages", self.num_pages, allow_none=True)
        _pos_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        fraction = self.gpu_memory_utilization
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= 1):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {fraction!r}")
        sizes = [name for name in ("num_pages", "kv_cache_memory_bytes", "gpu_memory_utilization")
                 if getattr(self, name) is not None]
        if len(sizes) > 1:
            raise ValueError(f"{sizes[0]} and {sizes[1]} both size the KV pool: give one of them")
        _pos_int("max_model_len", self.max_model_len, allow_none=True)
        if self.num_state_snapshots is not None and (isinstance(self.num_state_snapshots, bool) or not isinstance(
                self.num_state_snapshots, int) or self.num_state_snapshots < 0):
            raise ValueError(f"num_state_snapshots must be an integer >= 0, got {self.num_state_snapshots!r}")
        _pos_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_logprobs != -1 and (isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int)
                                        or self.max_logprobs < 0):
            raise ValueError(f"max_logprobs must be an integer >= 0 (0: the sampled token's logprob only), or -1 "
                             f"for no cap, got {self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        _pos_int("max_stop_ids", self.max_stop_ids)
        _pos_int("max_logit_bias", self.max_logit_bias)
        _pos_int("max_bad_words", self.max_bad_words)
        _pos_int("max_bad_word_tokens", self.max_bad_word_tokens)
        _pos_int("tensor_parallel_size", self.tensor_parallel_size)
        _pos_int("pipeline_parallel_size", self.pipeline_parallel_size)
        master_port, ranks_here = self._check_placement()
        kv_events = _check_kv_events_config(self.kv_events_config)
        if isinstance(self.data_parallel_rank, bool) or not isinstance(self.data_parallel_rank, int) or \
                not 0 <= self.data_parallel_rank < 65536:  # it offsets the KV events' TCP ports
            raise ValueError(f"data_parallel_rank must be an integer in [0, 65535], got {self.data_parallel_rank!r}")
        cpu_threads = _resolve_cpu_threads(self.cpu_threads, ranks_here)
        _pos_int("structured_max_states", self.structured_max_states)
        _pos_int("structured_max_exceptions", self.structured_max_exceptions)
        _pos_int("structured_compile_memory_bytes", self.structured_compile_memory_bytes)
        if isinstance(self.structured_compile_timeout, bool) or not isinstance(
                self.structured_compile_timeout, (int, float)) or not 0 < self.structured_compile_timeout < 1e9:
            raise ValueError(f"structured_compile_timeout must be a number of seconds > 0, got "
                             f"{self.structured_compile_timeout!r}")
        speculative = _check_speculative(self.speculative_config, self.page_size)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if not isinstance(self.cpu_huge_pages, bool):
            raise ValueError(f"cpu_huge_pages must be True or False, got {self.cpu_huge_pages!r}")
        for name in ("compile", "cuda_graphs", "check_bounds"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be True, False or None, got {getattr(self, name)!r}")

        if self.tokenizer is not None and (
                not isinstance(self.tokenizer, (str, os.PathLike)) or not os.path.isdir(self.tokenizer)
                or not any(os.path.exists(os.path.join(self.tokenizer, f)) for f in TOKENIZER_FILES)):
            raise ValueError(f"tokenizer must be a directory holding a HuggingFace tokenizer (one of "
                             f"{', '.join(TOKENIZER_FILES)}), got {self.tokenizer!r}")
        cfg = load_model_config(str(self.model))
        defaults = sampling_defaults(str(self.model), self.generation_config, self.override_generation_config)
        device = self._resolve_device()
        dtype = self._resolve_dtype(cfg, device)
        kv_dtype = self._resolve_kv_dtype(dtype)
        self._check_tensor_parallel(cfg, device)
        partition = self._check_pipeline(cfg, device)
        if cfg.linear is not None:
            _check_hybrid(cfg, speculative, self.tensor_parallel_size)
        check_lora_config(self, cfg, model_class(cfg), device)
        backend = choose_attention_backend(self.attention_backend, device, dtype, cfg.head_dim)
        max_len = self.max_model_len or cfg.max_position_embeddings
        if self.max_model_len is None and backend == "torch" and device.type == "cuda":
            # the torch reference gathers max_model_len worth of pages per row inside a graph
            max_len = min(max_len, TORCH_BACKEND_CUDA_MAX_LEN)
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_len}) exceeds the model's max_position_embeddings "
                f"({cfg.max_position_embeddings})"
            )
        eagle3 = mtp = None
        if speculative["speculative_method"] == "eagle3":
            eagle3 = read_eagle3_config(speculative["draft_model"], cfg)
            draft_cfg = eagle3.model
        elif speculative["speculative_method"] == "mtp":
            speculative["draft_model"] = speculative["draft_model"] or str(self.model)
            mtp = read_mtp_config(speculative["draft_model"], cfg, model_class(cfg))
            draft_cfg = mtp.model
        else:
            draft_cfg = _check_draft(speculative["draft_model"], cfg, max_len)
        # sliding windows (Mistral, Qwen2/3 with use_sliding_window, Phi-3, Gemma 3) are per-layer
        # AttentionSpecs that every backend path runs; pages wholly outside every layer's window are kept
        max_pages = -(-max_len // self.page_size)
        compile_ = self.compile if self.compile is not None else device.type == "cuda" and not self.enable_lora
        # on a CPU device, cuda_graphs=True runs the graph owner through its CPU twin (device/graph_runtime.py)
        graphs = self.cuda_graphs if self.cuda_graphs is not None else device.type == "cuda"
        snapshots = 0
        if cfg.linear is not None and self.enable_prefix_caching:
            snapshots = self.num_state_snapshots if self.num_state_snapshots is not None else max_batch_size
        states = state_cache_bytes(cfg, dtype, max_batch_size + snapshots, self.tensor_parallel_size)
        lora_bytes = lora_buffer_bytes(cfg, dtype, self.max_loras, self.max_lora_rank) if self.enable_lora else 0
        memory = _device_memory(device) if states or lora_bytes else 0  # asked once, and only if needed
        if states > memory:
            raise ValueError(f"num_state_snapshots ({snapshots}) and max_batch_size ({max_batch_size}): "
                             f"{states} bytes of recurrent states per rank exceed the device's {memory} bytes")
        if lora_bytes > memory:  # an absurd max_loras: refused here, not by the allocator
            raise ValueError(f"max_loras ({self.max_loras}) and max_lora_rank ({self.max_lora_rank}): {lora_bytes} "
                             f"bytes of adapter slots exceed the device's {memory} bytes")
        stage_layers = None  # a pipeline stage's KV layers: the most any stage holds
        if self.pipeline_parallel_size > 1:
            stage_layers = max(map(len, partition_layers(cfg.decoder_layers, self.pipeline_parallel_size, partition)))
        num_pages, source = self._kv_pool_pages(cfg, dtype, kv_dtype, device, max_pages, max_batch_size, draft_cfg,
                                                states, stage_layers)
        if num_pages < max_pages + 1:
            raise ValueError(
                f"{source} must hold one sequence of max_model_len ({max_len} tokens = "
                f"{max_pages} pages) plus the scratch page"
            )
        if num_pages >= 1 << 31:
            raise ValueError(f"{source}: more pages than int32 page ids can name (2**31 - 1)")
        resolved = {
            "model_config": cfg,
            "draft_model_config": draft_cfg,
            "eagle3_config": eagle3,
            "mtp_config": mtp,
            "torch_device": device,
            "torch_dtype": dtype,
            "kv_torch_dtype": kv_dtype,
            "max_model_len": max_len,
            "num_pages": num_pages,
            "attention_backend": backend,
            "compile": compile_,
            "cuda_graphs": graphs,
            "check_bounds": self.check_bounds if self.check_bounds is not None
            else os.environ.get("GRAPHDECODE_CHECK_BOUNDS", "") == "1",
            "max_batch_size": max_batch_size,
            "buckets": buckets,
            "cpu_threads": cpu_threads,
            "master_port": master_port,
            "pp_layer_partition": partition,
            "pp_micro_batches": self.pipeline_parallel_size if self.pp_micro_batches is None else self.pp_micro_batches,
            "kv_events_config": kv_events,
            "sampling_defaults": defaults,
            "max_pages_per_seq": max_pages,
            "num_state_snapshots": snapshots,
            # at least one entry: logprobs=0 still reports the sampled token's own
            "logprobs_width": cfg.vocab_size if self.max_logprobs == -1 else max(1, min(self.max_logprobs,
                                                                                        cfg.vocab_size)),
            **speculative,
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    def _resolve_device(self) -> torch.device:
        name = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(name)
        except (RuntimeError, TypeError):
            raise ValueError(f"device: {self.device!r} is not a torch device") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device: 'cuda' was asked for but CUDA is not available")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        return device

    def _resolve_dtype(self, cfg: ModelConfig, device: torch.device) -> torch.dtype:
        if self.dtype is None or self.dtype == "auto":  # "auto": vLLM's name for the default
            if device.type == "cpu":
                return torch.float32
            return cfg.dtype if cfg.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        if isinstance(self.dtype, torch.dtype) and self.dtype in _DTYPE_NAMES.values():
            return self.dtype
        if isinstance(self.dtype, str) and self.dtype in _DTYPE_NAMES:
            return _DTYPE_NAMES[self.dtype]
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16 (or float, half), got {self.dtype!r}")

    def _resolve_kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            return dtype
        if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):
            return FP8
        if self.kv_cache_dtype == "fp8_e5m2":
            raise ValueError("kv_cache_dtype 'fp8_e5m2' is not supported: FP8 KV caches are E4M3 ('fp8')")
        raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {self.kv_cache_dtype!r}")


    @property
    def world_size(self) -> int:
        """The engine's ranks: tensor_parallel_size in each of pipeline_parallel_size stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_pipeline(self, cfg: ModelConfig, device: torch.device) -> tuple[int, ...] | None:
        """pp_layer_partition as a tuple (None: the even split); ValueError naming what pipeline stages cannot run."""
        pp, layers, partition = self.pipeline_parallel_size, cfg.decoder_layers, self.pp_layer_partition
        if partition is not None:
            try:
                parts = tuple(int(x) for x in (partition.split(",") if isinstance(partition, str) else partition))
            except (TypeError, ValueError):
                parts = ()
            if (isinstance(partition, (bytes, dict)) or len(parts) != pp or any(p < 1 for p in parts)
                    or sum(parts) != layers):
                raise ValueError(f"pp_layer_partition must give each of the {pp} stages >= 1 of the {layers} decoder "
                                 f"layers (summing to {layers}), got {partition!r}")
            partition = parts
        micro = self.pp_micro_batches
        if micro is not None and (isinstance(micro, bool) or not isinstance(micro, int) or
                                  not (micro == 1 or micro >= pp)):
            raise ValueError(f"pp_micro_batches must be 1 (none in flight together) or >= pipeline_parallel_size "
                             f"({pp}), got {micro!r}")
        if pp == 1:
            return partition
        if pp > layers:
            raise ValueError(f"pipeline_parallel_size ({pp}) exceeds the model's {layers} decoder layers")
        if device.type != "cpu":
            raise ValueError("pipeline_parallel_size: pipeline stages run on CPU ranks (gloo) so far; on CUDA use "
                             "tensor_parallel_size")
        if self.compile:
            raise ValueError("pipeline_parallel_size: compile=True does not run over pipeline stages yet "
                             "(torch.compile cannot trace their point-to-point hand-offs); leave compile off (the CPU "
                             "default)")
        from .models.decoder import DecoderForCausalLM
        from .models.registry import model_class

        family = model_class(cfg)
        if getattr(family, "forward_aux", None) is not DecoderForCausalLM.forward_aux:
            raise ValueError(f"pipeline_parallel_size: {family.__name__} runs a layer loop of its own, which pipeline "
                             f"stages do not split yet; use tensor_parallel_size")
        return partition

    @property
    def spec_history(self) -> bool:
        """Whether speculation keeps each row's token history on the device: n-gram drafts are looked up in it, a
        draft model catches up from it; a draft head reads the target's hidden states instead."""
        return self.speculative_method in ("ngram", "draft_model")

    @property
    def window_tokens(self) -> int:
        """Most tokens a row can gain in one window: k, or k (d + 1) when speculating."""
        return self.num_decode_steps * (self.num_speculative_tokens + 1)

    def _check_placement(self) -> tuple[int | None, int]:
        """(master_port resolved, this machine's ranks) from the fields that place the ranks; ValueError naming
        the field (under a launcher: the environment variable) that cannot be right."""
        backend, nnodes, tp = self.distributed_executor_backend, self.nnodes, self.world_size
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(map(repr, EXECUTOR_BACKENDS))}"
                             f", got {backend!r:.200}")
        _pos_int("nnodes", nnodes)
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) or not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank must be an integer in [0, nnodes) = [0, {nnodes}), got {self.node_rank!r}")
        if tp % nnodes:
            raise ValueError(f"nnodes ({nnodes}) must divide the ranks, tensor_parallel_size x pipeline_parallel_size "
                             f"({tp}): each machine holds as many")
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise ValueError(f"master_addr must be a host name or address, got {self.master_addr!r:.200}")
        port = self.master_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"master_port must be a port number in 1..65535, got {port!r}")
        if backend == "external_launcher":
            if nnodes != 1:
                raise ValueError("nnodes: under distributed_executor_backend 'external_launcher' the launcher places "
                                 "the ranks (torchrun --nnodes); leave nnodes at 1")
            env = launcher_env()
            if tp > 1 and int(env["WORLD_SIZE"]) != tp:
                raise ValueError(f"tensor_parallel_size x pipeline_parallel_size ({tp}) must equal the launcher's "
                                 f"WORLD_SIZE ({env['WORLD_SIZE']}): every rank of the job is one of the engine's")
            return port, max(1, int(env.get("LOCAL_WORLD_SIZE", tp)))
        if backend == "ray":
            if importlib.util.find_spec("ray") is None:
                raise ValueError("distributed_executor_backend 'ray' needs the ray package: pip install ray")
            if nnodes != 1:
                raise ValueError("nnodes: under distributed_executor_backend 'ray' Ray places the ranks on its "
                                 "cluster's nodes; leave nnodes at 1")
        if nnodes > 1 and port is None:
            port = DEFAULT_MASTER_PORT
        return port, tp // nnodes

    def _check_tensor_parallel(self, cfg: ModelConfig, device: torch.device) -> None:
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        if cfg.num_heads % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide num_attention_heads ({cfg.num_heads})")
        if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size ({tp}) and num_key_value_heads ({cfg.num_kv_heads}) must divide one another"
            )
        if cfg.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide intermediate_size ({cfg.intermediate_size})")
        if device.type == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size ({tp}) exceeds the {torch.cuda.device_count()} visible GPUs")
        if device.type == "cuda" and device.index not in (None, 0):
            raise ValueError("tensor_parallel_size: ranks run on cuda:0..N-1; choose device='cuda'")

    def _kv_pool_pages(self, cfg: ModelConfig, dtype, kv_dtype, device, max_pages: int, max_batch_size: int,
                       draft: ModelConfig | None, states: int = 0, layers: int | None = None) -> tuple[int, str]:
        """(num_pages, what sized the pool, as errors name it): the rules are the fields' comment. A page
        holds the target's K/V (in kv_dtype) and, with a draft model, the draft's (in dtype, replicated on every
        rank). states: a hybrid's recurrent-state slots' bytes, taken from the same budget first; layers: the KV
        layers a rank holds (a pipeline stage's; None: every layer)."""
        if self.num_pages is not None:
            return self.num_pages, f"num_pages ({self.num_pages})"
        tp = self.tensor_parallel_size
        kv_heads = max(1, cfg.num_kv_heads // tp)  # one rank's share (replicated when fewer heads than ranks)
        per_page = kv_bytes_per_page(layers or cfg.num_layers, self.page_size, kv_heads, cfg.head_dim, kv_dtype)
        if draft is not None:
            per_page += kv_bytes_per_page(draft.num_layers, self.page_size, draft.num_kv_heads, draft.head_dim, dtype)
        wanted = max_batch_size * max_pages + 1
        size, source = self.kv_cache_memory_bytes, f"kv_cache_memory_bytes ({self.kv_cache_memory_bytes})"
        if size is None and self.gpu_memory_utilization is None and device.type == "cpu":
            size = _env_kvcache_bytes()
            if size is None:  # the fixed CPU default, never refused: at least one sequence
                return (max(min(wanted, max(CPU_KV_BUDGET_BYTES - states, 0) // per_page), max_pages + 1),
                        "the default KV pool")
            source = f"{CPU_KVCACHE_SPACE_ENV} ({os.environ[CPU_KVCACHE_SPACE_ENV].strip()} GiB)"
        if size is not None:
            pages = max(size - states, 0) // per_page
            held = f" after {states} bytes of recurrent states" if states else ""
            return pages, f"{source}, {pages} pages of {per_page} bytes{held},"
        fraction = self.gpu_memory_utilization or GPU_MEMORY_FRACTION
        weights = model_weight_bytes(cfg, dtype) + (model_weight_bytes(draft, dtype) * tp if draft is not None else 0)
        weights += lora_buffer_bytes(cfg, dtype, self.max_loras, self.max_lora_rank) if self.enable_lora else 0
        if device.type == "cpu":
            # the ranks are processes sharing the host's RAM; the weights counted twice (a bound: fp32 linears keep
            # panels and a packed copy in place of the parameter, a tied head a packed copy, docs/cpu.md)
            free, total = _host_memory()
            weights *= 2
            budget = (int(total * fraction) - (total - free) - weights - tp * ACTIVATION_RESERVE_BYTES) // tp
        else:
            free, total = torch.cuda.mem_get_info(device)
            budget = int(total * fraction) - (total - free) - weights // tp - ACTIVATION_RESERVE_BYTES
        budget -= states
        pages = min(wanted, max(budget, 0) // per_page)
        if self.gpu_memory_utilization is None:  # the CUDA default: at least one sequence
            return max(pages, max_pages + 1), "the default KV pool"
        gib = 1 << 30
        return pages, (f"gpu_memory_utilization ({fraction}: {fraction * total / gib:.2f} of {total / gib:.2f} GiB, "
                       f"{(total - free) / gib:.2f} GiB in use now, weights {weights / gib:.2f} GiB, activation "
                       f"reserve {ACTIVATION_RESERVE_BYTES / gib:.0f} GiB: {pages} pages of {per_page} bytes)")


def state_cache_bytes(cfg: ModelConfig, dtype: torch.dtype, slots: int, ranks: int = 1) -> int:
    """A hybrid's recurrent-state cache on one tensor-parallel rank (attention/state_cache.py): `slots` slots
    (live and snapshots) and the scratch one, of the rank's share of the recurrent heads."""
    if cfg.linear is None:
        return 0
    return (slots + 1) * len(cfg.linear_layers) * slot_bytes(cfg.linear.local(ranks), dtype)


def _check_hybrid(cfg: ModelConfig, speculative: dict, tensor_parallel_size: int) -> None:
    """A hybrid model's limits (recurrent layers), refused by the field's name."""
    tp, lin = tensor_parallel_size, cfg.linear
    if tp > 1:
        heads = {"linear_num_key_heads": getattr(lin, "num_key_heads", None), "mamba_num_heads":
                 getattr(lin, "num_heads", None), "n_groups": getattr(lin, "n_groups", None)}
        for name, count in heads.items():
            if count is not None and count % tp:
                raise ValueError(f"tensor_parallel_size ({tp}) must divide {name} ({count}): a hybrid's recurrent "
                                 f"heads are split across ranks")
        if cfg.weight_quant is not None:
            raise ValueError(f"tensor_parallel_size ({tp}): a quantized hybrid model runs on one rank")


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3", "mtp")
NOT_YET = ("eagle",)  # vLLM's names for methods graphdecode does not run yet
SPECULATIVE_DEFAULTS = {"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def _check_speculative(spec, page_size: int) -> dict:
    """vLLM's speculative_config, validated by name -> the resolved fields (no file is read here)."""
    off = {"speculative_method": None, "draft_model": None, "num_speculative_tokens": 0, "prompt_lookup_max": 0,
           "prompt_lookup_min": 0}
    if spec is None:
        return off
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict (or None), got {spec!r}")
    method = spec.get("method", "ngram")
    if method not in SPECULATIVE_METHODS:
        later = " (EAGLE-1 heads are not supported yet)" if method in NOT_YET else ""
        raise ValueError(f"speculative_config: method must be 'ngram' (prompt lookup), 'draft_model', 'eagle3' or "
                         f"'mtp' (the target's own MTP layers), got {method!r}{later}")
    ngram = method == "ngram"
    known = {"method", "num_speculative_tokens"} | ({"prompt_lookup_max", "prompt_lookup_min"} if ngram else {"model"})
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r} for method {method!r} "
                         f"(known: {', '.join(sorted(known))})")
    resolved = {name: spec.get(name, default) for name, default in SPECULATIVE_DEFAULTS.items()}
    for name, value in resolved.items():
        _pos_int(f"speculative_config.{name}", value)
    if resolved["num_speculative_tokens"] >= page_size:
        raise ValueError(
            f"speculative_config.num_speculative_tokens ({resolved['num_speculative_tokens']}) must be below "
            f"page_size ({page_size})"
        )
    if resolved["prompt_lookup_min"] > resolved["prompt_lookup_max"]:
        raise ValueError("speculative_config: prompt_lookup_min must not exceed prompt_lookup_max")
    draft = spec.get("model")
    optional = method == "mtp" and draft is None  # the MTP layers are the target's own
    if not ngram and not optional and (not isinstance(draft, (str, os.PathLike)) or not os.path.isdir(draft)):
        what = {"eagle3": "EAGLE-3 head", "mtp": "target (whose checkpoint holds the MTP layers)"}.get(method,
                                                                                                    "draft model")
        raise ValueError(f"speculative_config.model must be the {what}'s HuggingFace directory, got {draft!r}")
    if not ngram:
        resolved["prompt_lookup_max"] = resolved["prompt_lookup_min"] = 0
    return {**resolved, "speculative_method": method, "draft_model": None if ngram or optional else str(draft)}


def _check_draft(path: str | None, target: ModelConfig, max_len: int) -> ModelConfig | None:
    """The draft model's config.json, checked against the target's before any weight is read."""
    if path is None:
        return None
    from .models.registry import model_class

    try:
        draft = load_model_config(path)
        model_class(draft)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocab_size ({draft.vocab_size}) differs from the "
                         f"target's ({target.vocab_size}); a draft model must share the target's tokenizer")
    if draft.linear is not None:
        raise ValueError("speculative_config.model: a hybrid draft model (linear-attention layers) is not supported; "
                         "the draft keeps K/V in the target's pages")
    if draft.max_position_embeddings < max_len:
        raise ValueError(f"speculative_config.model: the draft's max_position_embeddings "
                         f"({draft.max_position_embeddings}) is below max_model_len ({max_len})")
    return draft


def choose_attention_backend(requested: str | None, device: torch.device, dtype: torch.dtype, head_dim: int,
                             probe=None) -> str:
    """The backend that will run: never one that cannot (checked before any work).

    Automatic (None): FlashInfer on CUDA when it can run this head_dim and dtype here,
    else the torch reference, with one log line saying why. An explicit "flashinfer"
    that cannot run raises a ValueError naming head_dim / dtype.
    """
    if probe is None:
        from .attention.flashinfer_probe import flashinfer_unavailable_reason as probe
    if requested is None:
        if device.type != "cuda":
            return "torch"
        reason = probe(head_dim, dtype)
        if reason is None:
            return "flashinfer"
        logger.warning("graphdecode: attention backend 'torch', not FlashInfer: %s", reason)
        return "torch"
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    if requested == "flashinfer":
        if device.type != "cuda":
            raise ValueError("attention_backend 'flashinfer' needs a CUDA device")
        reason = probe(head_dim, dtype)
        if reason is not None:
            raise ValueError(f"attention_backend 'flashinfer' cannot run here: {reason}")
    return requested


def model_weight_bytes(cfg: ModelConfig, dtype) -> int:
    """The checkpoint's weights in `dtype`: what a decode step reads once (whatever layout holds them); an
    MoE's every expert (what the weights occupy; a step reads only the experts its tokens route to)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    if cfg.mla is None:
        attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim * h
    else:  # latent attention: q (through q_lora_rank or not), the latent, kv_b_proj, o_proj
        m, heads = cfg.mla, cfg.num_heads
        q = (h + heads * m.qk_head_dim) * m.q_lora_rank if m.q_lora_rank else h * heads * m.qk_head_dim
        kv_b = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        attn = q + h * m.cache_dim + kv_b + heads * m.v_head_dim * h
    dense, moe = attn + 3 * h * i, cfg.moe
    sparse = 0 if moe is None else attn + moe.num_experts * (h + 3 * h * moe.intermediate_size)  # router + experts
    count = sum(sparse if moe is not None and moe.is_sparse(layer) else dense for layer in range(cfg.decoder_layers))
    count += v * h * (1 if cfg.tie_word_embeddings else 2)
    size = torch.tensor([], dtype=dtype).element_size()
    if moe is not None and cfg.quantization == "mxfp4":  # the experts stay MXFP4: 17 bytes per 32 weights
        experts = sum(moe.is_sparse(layer) for layer in range(cfg.decoder_layers)) * moe.num_experts * 3 * h * \
            moe.intermediate_size
        return (count - experts) * size + experts * 17 // 32
    return count * size
