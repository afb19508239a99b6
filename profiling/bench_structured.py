"""Structured outputs in the window: constrained against unconstrained decode, and compile times.

One run, one engine, the same k and model for both sides:

* decode tokens/s at each batch: B prompts, every row constrained by a JSON schema (an
  8-field object with a nested object, an enum, an array and free strings: a row ends at
  EOS when its object is complete), against the same prompts unconstrained, each row
  generating exactly as many tokens as its constrained twin (ignore_eos). tokens/s =
  generated tokens / wall time of the whole run, the two sides alternating --repeats
  times so drift hits both alike; the ratio is that of the median runs (`best_ratio`:
  of the best ones);
* the schema's compile time cold (a fresh disk cache) and cached (memory hit, disk hit),
  the automaton's size, and what a cached schema adds to a request's admission (prepare +
  table placement, measured against the same request without the constraint).

    python profiling/bench_structured.py                        # SmolLM2-135M-Instruct, CPU
    python profiling/bench_structured.py --preset default --batches 1,4 --repeats 1

Writes PREFIX.json and prints a table (constrained / unconstrained tokens/s: the goal is
>= 0.9 at every batch; cached admission cost: the goal is < 1 ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from graphdecode.bench.common import add_compile_arg, compile_option, machine_info, resolve_model, write_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "maxLength": 8}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "email", "age", "score", "active", "role", "tags", "address"],
}
PROMPT = "Write the JSON record of a user of our service:"


def with_tokenizer(model_dir: str) -> str:
    """model_dir itself when it has a tokenizer; else a cached twin (links to its config and
    weights) with the built-in byte-level BPE tokenizer, so a tokenizer-less preset such as
    llama-3.2-1b (128k vocabulary) can be constrained: its masks are vocab-wide, while only
    the tokenizer's 512 ids are ever allowed."""
    if any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return model_dir
    from graphdecode.cache import cached_model_dir
    from graphdecode.default_model import build_tokenizer

    def build(path: str) -> None:
        for name in os.listdir(model_dir):
            os.symlink(os.path.join(os.path.abspath(model_dir), name), os.path.join(path, name))
        build_tokenizer().save_pretrained(path)

    return cached_model_dir(os.path.basename(os.path.normpath(model_dir)) + "-with-tokenizer", build)


def _constraint():
    from graphdecode import StructuredOutputsParams

    return StructuredOutputsParams(json=SCHEMA)


def measure_compile(llm) -> dict:
    """Cold compile (a fresh disk cache), then a memory hit and a disk hit; the table sizes."""
    from graphdecode.structured import AutomatonCache, compile_constraint

    tokenizer, cfg = llm.get_tokenizer(), llm.config.model_config
    constraint = _constraint()  # built (and its schema checked) outside the timings: a request brings it built
    with tempfile.TemporaryDirectory() as tmp:
        cache = AutomatonCache(tmp)

        def timed() -> tuple[float, object]:
            start = time.perf_counter()
            automaton = compile_constraint(constraint, tokenizer, cfg.vocab_size, cfg.eos_token_ids, cache=cache)
            return time.perf_counter() - start, automaton

        cold, automaton = timed()
        memory, _ = timed()
        cache.clear_memory()
        disk, _ = timed()
    return {"cold_s": cold, "memory_hit_s": memory, "disk_hit_s": disk, "states": automaton.num_states,
            "exceptions": automaton.num_exceptions, "max_exceptions_per_state": automaton.max_exceptions,
            "table_bytes": automaton.nbytes}


def measure_admission(llm, repeats: int = 200) -> dict:
    """prepare + table placement of one request (add_requests' first half), with a cached constraint
    and without one (best of)."""
    from graphdecode import SamplingParams

    engine = llm.engine
    (text, ids), = engine.inputs.tokenize_all([PROMPT])
    plain = SamplingParams(temperature=0, max_tokens=64)
    constrained = SamplingParams(temperature=0, max_tokens=256, structured_outputs=_constraint())

    def best(params) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            request = engine.prepare(text, ids, params)
            engine.place_tables(request)
            times.append(time.perf_counter() - start)
            engine.release_tables(request)
        return min(times)

    best(constrained)  # compiled and placed once: what follows is the cached path
    with_constraint, without = best(constrained), best(plain)
    return {"cached_s": with_constraint, "plain_s": without, "added_s": with_constraint - without}


def measure_decode(llm, batch: int, max_tokens: int, repeats: int) -> dict:
    """The constrained rows run to their EOS; each unconstrained row then generates exactly as
    many tokens as its constrained twin did (ignore_eos), so both sides do the same work with the
    same batch shrinking at the same steps, and only the constraint's own cost differs."""
    from graphdecode import SamplingParams

    prompts = [f"{PROMPT} (user {i})" for i in range(batch)]
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=_constraint())
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, constrained)]  # compiles, places, warms
    sides = {
        "unconstrained": [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
        "constrained": constrained,
    }
    llm.generate(prompts, sides["unconstrained"])  # warms its variants
    best: dict[str, dict] = {}
    walls: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, params in sides.items():
            before = llm.stats()["windows"]
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - start
            walls[name].append(wall)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            point = {"tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens,
                     "mean_output_tokens": tokens / batch, "windows": llm.stats()["windows"] - before,
                     "finished_stop": sum(o.outputs[0].finish_reason == "stop" for o in outs)}
            if name not in best or point["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = point
    best["walls_s"] = walls
    best["best_ratio"] = best["constrained"]["tokens_per_s"] / best["unconstrained"]["tokens_per_s"]
    # the ratio of the median runs (the same tokens on both sides): steadier than the best on a shared host
    best["ratio"] = statistics.median(walls["unconstrained"]) / statistics.median(walls["constrained"])
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HuggingFace model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--preset", default=None, help="a model preset instead (e.g. default)")
    p.add_argument("--device", default=None)
    p.add_argument("--batches", default="1,16,64", help="batch sizes (default 1,16,64)")
    p.add_argument("-k", "--num-decode-steps", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=160, help="per row (constrained rows end earlier, at EOS)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench_structured", help="output prefix (PREFIX.json)")
    add_compile_arg(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None and args.preset is None:
        from graphdecode.gguf_import import smollm2_dir

        model, name = smollm2_dir(), "SmolLM2-135M-Instruct"
    else:
        model, name = resolve_model(args.model, args.preset, args.device)
    model = with_tokenizer(model)
    from graphdecode import LLM

    batches = [int(b) for b in args.batches.split(",")]
    device = {"device": args.device} if args.device else {}
    llm = LLM(model, num_decode_steps=args.num_decode_steps, max_batch_size=max(batches),
              max_model_len=1024, cpu_threads=args.threads, **device, **compile_option(args))
    result = {"model": name, "machine": machine_info(llm.config.torch_device, args.threads),
              "k": args.num_decode_steps, "compile": measure_compile(llm), "admission": measure_admission(llm),
              "points": {}}
    for batch in batches:
        result["points"][batch] = measure_decode(llm, batch, args.max_tokens, args.repeats)
    result["goals"] = {
        "constrained >= 0.9x unconstrained tokens/s at every batch": all(
            point["ratio"] >= 0.9 for point in result["points"].values()),
        "a cached schema adds < 1 ms to admission": result["admission"]["added_s"] < 1e-3,
    }
    write_json(args.out + ".json", result)
    c = result["compile"]
    print(f"{name}, k={args.num_decode_steps}: schema {c['states']} states, {c['exceptions']} exceptions, "
          f"{c['table_bytes'] / 1e6:.2f} MB; compile cold {c['cold_s']:.2f} s, memory hit "
          f"{c['memory_hit_s'] * 1e6:.0f} us, disk hit {c['disk_hit_s'] * 1e3:.1f} ms; cached admission adds "
          f"{result['admission']['added_s'] * 1e6:.0f} us")
    print("batch  unconstrained tok/s  constrained tok/s (mean len, windows)  ratio (median runs, best runs)")
    for batch, point in result["points"].items():
        u, s = point["unconstrained"], point["constrained"]
        print(f"{batch:>5}  {u['tokens_per_s']:>19.1f}  {s['tokens_per_s']:>17.1f} ({s['mean_output_tokens']:.0f}, "
              f"{s['windows']})  {point['ratio']:.2f}, {point['best_ratio']:.2f}")
    for goal, met in result["goals"].items():
        print(f"{'met' if met else 'NOT met'}: {goal}")
    print(f"wrote {args.out}.json")
    return result


if __name__ == "__main__":
    main()
