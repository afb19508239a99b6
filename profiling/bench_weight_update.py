"""What a weight update costs an RL loop: an engine's weights replaced in place (LLM.update_weights from tensors in
memory, as a trainer in the same process sends them; LLM.update_weights_from_disk from a saved checkpoint) beside
what a loop without updates does, building a new LLM from the new checkpoint (load, CPU layouts, kernels) and
running its first token. Each round times all three, alternating the checkpoint between the model and a
"trained" copy (every weight moved by noise); after each update the engine's greedy tokens are checked against
the fresh engine's (they must be equal). Medians over --rounds. Results go to BENCHMARKS.md ("Weight updates").

    python profiling/bench_weight_update.py --threads 2
    python profiling/bench_weight_update.py --threads 2 --dtype bfloat16 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch


def trained_copy(model: str, out: str, seed: int = 0) -> str:
    """A copy of the checkpoint with every float tensor moved by noise of a third of its spread (made once)."""
    from safetensors.torch import load_file, save_file

    from graphdecode.models.loader import checkpoint_files

    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    shutil.copytree(model, out, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for path in checkpoint_files(out):
        tensors = load_file(path)
        for key, t in tensors.items():
            if t.is_floating_point():
                noise = torch.randn(t.shape, generator=generator) * max(float(t.float().std()), 0.02) / 3
                tensors[key] = (t.float() + noise).to(t.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="(default: the engine's)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of the engines")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trained", default=None, help="where the trained copy is made (default: in the cache directory, "
                                                    "per model)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    from safetensors.torch import load_file

    from graphdecode import LLM, SamplingParams
    from graphdecode.bench.common import write_json
    from graphdecode.cache import cache_root
    from graphdecode.gguf_import import smollm2_dir
    from graphdecode.models.loader import checkpoint_files

    model = args.model or smollm2_dir()
    trained = trained_copy(model, args.trained or os.path.join(cache_root(), "weight_update",
                                                               os.path.basename(model) + "-trained"))
    engine = dict(max_batch_size=4, max_model_len=256, cpu_threads=args.threads,
                  **({"dtype": args.dtype} if args.dtype else {}))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [1, 50, 345, 28, 464, 314]}]
    checkpoints = {path: {k: v for f in checkpoint_files(path) for k, v in load_file(f).items()}
                   for path in (model, trained)}
    nbytes = sum(t.numel() * t.element_size() for t in checkpoints[model].values())

    def tokens(llm):
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    llm = LLM(model, **engine)
    want = {}
    for path in (model, trained):
        with LLM(path, **engine) as fresh:
            want[path] = tokens(fresh)
    assert want[model] != want[trained], "the trained copy must answer differently"
    times = {"update_weights": [], "update_weights_from_disk": [], "new_llm": []}
    target = model
    for _ in range(args.rounds):
        for kind in ("update_weights", "update_weights_from_disk"):
            target = trained if target == model else model
            t0 = time.perf_counter()
            if kind == "update_weights":
                llm.update_weights(checkpoints[target])
            else:
                llm.update_weights_from_disk(target)
            times[kind].append(time.perf_counter() - t0)
            assert tokens(llm) == want[target], f"{kind}: the updated engine's tokens differ from a fresh engine's"
        t0 = time.perf_counter()
        with LLM(target, **engine) as fresh:
            tokens_fresh = fresh.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
        times["new_llm"].append(time.perf_counter() - t0)
        assert tokens_fresh
    llm.close()
    medians = {kind: statistics.median(ts) for kind, ts in times.items()}
    results = {"model": model, "dtype": str(llm.config.torch_dtype), "threads": args.threads, "rounds": args.rounds,
               "checkpoint_bytes": nbytes, "seconds": times, "median_seconds": medians,
               "speedup_over_new_llm": {k: medians["new_llm"] / medians[k] for k in ("update_weights",
                                                                                      "update_weights_from_disk")}}
    for kind, median in medians.items():
        print(f"{kind:26s} median {median * 1e3:8.1f} ms  ({nbytes / median / 2**30:5.2f} GiB/s of checkpoint)"
              f"  x{medians['new_llm'] / median:5.1f} vs a new LLM", flush=True)
    if args.out:
        write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
