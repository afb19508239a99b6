"""Speculative decoding (drafts verified in the window) against plain decoding, in one run.

SmolLM2-135M-Instruct (default; --model for another), chat template, batch 1 and 8
(--batches), two prompt sets:
* input-grounded: the answer copies from the prompt (repeat or rewrite a passage, edit
  a code block);
* open-ended: nothing to copy (n-gram drafts find nothing: the host should fall back to
  plain windows; a draft model still drafts).
Methods (--methods): ngram, draft_model with --draft-model DIR (or --distilled-layers L:
the draft profiling/distil_draft.py distils for the target, built once and cached), and eagle3
with --eagle3-head DIR (or, without it, the head profiling/distil_eagle3.py distils with its defaults,
cached). At each temperature (--temperatures; above 0 seeded). Per (method, set, temperature, batch): decode
tokens/s with and without speculation (each engine's fastest of --repeats runs), accepted drafts per verify,
the share of windows that speculated, and the ratio of the fastest runs and the median of each round's ratio
(the two engines' runs side by side: robust to a box whose speed drifts); the outputs must be identical
(speculation changes speed, never tokens).

    python profiling/bench_spec.py --out profiling/out/bench_spec
    python profiling/bench_spec.py --methods ngram,draft_model,eagle3 --distilled-layers 4 \
        --batches 1,4,16 --temperatures 0,0.7 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from graphdecode.bench.common import add_compile_arg, compile_option, machine_info, script_module, write_json

PASSAGE = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, "
           "the members agreed to fund the children's reading room, to repair the roof before winter, and to "
           "extend the opening hours on weekends. The final vote was seven in favour and two against.")
CODE = ("def moving_average(values, window):\n    result = []\n    for i in range(len(values) - window + 1):\n"
        "        chunk = values[i:i + window]\n        result.append(sum(chunk) / window)\n    return result\n")
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this code, renaming the function to rolling_mean and keeping everything else the same:\n\n{CODE}",
    f"Copy this paragraph and then say how many votes were cast:\n\n{PASSAGE}",
    f"Here is a function:\n\n{CODE}\nWrite it out again with a docstring added.",
]
OPEN_ENDED = [
    "Write a short story about a dragon who is afraid of the dark.",
    "What are three good reasons to learn a second language?",
    "Describe your ideal weekend in a few sentences.",
    "Explain why the sky is blue to a ten-year-old.",
]


def _prompts(llm, texts: list[str], batch: int) -> list[dict]:
    tokenizer = llm.get_tokenizer()
    out = []
    for i in range(batch):
        text = texts[i % len(texts)]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        out.append({"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]})
    return out


def _run(llm, prompts, params) -> dict:
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = llm.stats()
    return {
        "seconds": seconds,
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "outputs": [o.outputs[0].token_ids for o in outs],
        "verifies": after["spec_verifies"] - before["spec_verifies"],
        "accepted": after["spec_accepted_tokens"] - before["spec_accepted_tokens"],
        "spec_windows": after["spec_windows"] - before["spec_windows"],
        "windows": after["windows"] - before["windows"],
    }


def measure(engines: dict, prompts, params, repeats: int) -> dict:
    """Each engine's fastest of `repeats` runs, with `rates`, its tokens/s run by run; the engines
    alternate run by run, the first to run changing each round, so a machine whose speed drifts (a
    shared host) drifts both alike."""
    for llm in engines.values():
        llm.generate(prompts[:1], params)  # warm-up
    best: dict = {name: None for name in engines}
    rates: dict = {name: [] for name in engines}
    names = list(engines)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run = _run(engines[name], prompts, params)
            rates[name].append(run["tokens"] / run["seconds"])
            if best[name] is None or run["seconds"] < best[name]["seconds"]:
                best[name] = run
    for name, run in best.items():
        run["tokens_per_s"] = run["tokens"] / run["seconds"]
        run["rates"] = rates[name]
        run["accepted_per_verify"] = run["accepted"] / run["verifies"] if run["verifies"] else 0.0
        run["spec_window_share"] = run["spec_windows"] / run["windows"] if run["windows"] else 0.0
    return best


def main(argv=None) -> dict:
    from graphdecode import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HuggingFace model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--preset", default=None, help="a model preset with a tokenizer instead (e.g. micro: the GPU check)")
    p.add_argument("--device", default=None)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=8, help="decode steps (rounds) per window")
    p.add_argument("-d", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--repeats", type=int, default=3, help="runs per engine and point (alternating)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", default="ngram", help="comma-separated: ngram, draft_model, eagle3")
    p.add_argument("--draft-model", default=None, help="the draft_model method's checkpoint directory")
    p.add_argument("--distilled-layers", type=int, default=None,
                   help="draft_model: the draft distil_draft.py builds with this many layers (cached)")
    p.add_argument("--distil-minutes", type=float, default=20.0, help="draft_model: distil_draft.py's training time")
    p.add_argument("--eagle3-head", default=None,
                   help="eagle3: the head's directory (default: distil_eagle3.py's for the target, cached)")
    p.add_argument("--eagle3-d", type=int, default=None, help="eagle3's num_speculative_tokens (default: -d)")
    p.add_argument("--temperatures", default="0", help="comma-separated; above 0 seeded")
    add_compile_arg(p)
    p.add_argument("--out", default="profiling/out/bench_spec")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.preset is not None:
        from graphdecode.bench.presets import ensure_preset

        args.model = ensure_preset(args.preset, args.device)
    if args.model is None:
        from graphdecode.gguf_import import smollm2_dir

        args.model = smollm2_dir()
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(device=args.device, num_decode_steps=args.k, max_batch_size=max(batches), max_model_len=1024,
                  enable_prefix_caching=False, cpu_threads=args.threads, **compile_option(args))
    methods = [m.strip() for m in args.methods.split(",")]
    if "draft_model" in methods and args.draft_model is None:
        if args.distilled_layers is None:
            raise SystemExit("--methods draft_model needs --draft-model DIR or --distilled-layers L")
        args.draft_model = _distilled(args)
    if "eagle3" in methods and args.eagle3_head is None:
        args.eagle3_head, _ = _sibling("distil_eagle3").distilled_head(args.model, threads=args.threads)
    plain = LLM(args.model, **common)
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.d},
               "draft_model": {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.d},
               "eagle3": {"method": "eagle3", "model": args.eagle3_head,
                          "num_speculative_tokens": args.eagle3_d or args.d}}
    engines = {m: LLM(args.model, speculative_config=configs[m], **common) for m in methods}
    temperatures = [float(t) for t in args.temperatures.split(",")]
    result = {"bench": "speculative", "model": os.path.basename(os.path.normpath(args.model)), "args": vars(args),
              "machine": machine_info(plain.config.torch_device, args.threads), "points": []}
    for method, spec in engines.items():
        for name, texts in (("input-grounded", GROUNDED), ("open-ended", OPEN_ENDED)):
            for temperature in temperatures:
                params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                        seed=7 if temperature > 0 else None)
                for batch in batches:
                    prompts = _prompts(plain, texts, batch)
                    runs = measure({"plain": plain, "spec": spec}, prompts, params, args.repeats)
                    base, fast = runs["plain"], runs["spec"]
                    point = {
                        "method": method, "set": name, "temperature": temperature, "batch": batch,
                        "plain_tokens_per_s": base["tokens_per_s"], "spec_tokens_per_s": fast["tokens_per_s"],
                        "speedup": fast["tokens_per_s"] / base["tokens_per_s"],
                        # each round's ratio (the two engines' runs side by side), their median
                        "speedup_paired": statistics.median(f / b for f, b in zip(fast["rates"], base["rates"])),
                        "accepted_per_verify": fast["accepted_per_verify"],
                        "spec_window_share": fast["spec_window_share"],
                        "same_tokens": fast["outputs"] == base["outputs"], "tokens": base["tokens"],
                    }
                    result["points"].append(point)
                    print(f"[spec] {method} {name} T={temperature:g} batch {batch}: "
                          f"{point['plain_tokens_per_s']:.1f} -> {point['spec_tokens_per_s']:.1f} tok/s "
                          f"({point['speedup']:.2f}x best, {point['speedup_paired']:.2f}x paired), "
                          f"{point['accepted_per_verify']:.2f} accepted/verify", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out + ".json", result)
    print(f"{'method':<12} {'set':<15} {'T':>4} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} "
          f"{'paired':>7} {'acc/verify':>11} {'spec share':>11} {'same':>5}")
    for pt in result["points"]:
        print(f"{pt['method']:<12} {pt['set']:<15} {pt['temperature']:>4g} {pt['batch']:>5} "
              f"{pt['plain_tokens_per_s']:>12.1f} {pt['spec_tokens_per_s']:>11.1f} "
              f"{pt['speedup']:>7.2f}x {pt['speedup_paired']:>6.2f}x {pt['accepted_per_verify']:>11.2f} "
              f"{pt['spec_window_share']:>11.2f} "
              f"{str(pt['same_tokens']):>5}")
    print(f"(wrote {args.out}.json)")
    return result


def _sibling(name: str):
    """A script beside this one, as a module."""
    return script_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))


def _distilled(args) -> str:
    """distil_draft.py's draft for the target (built once: --distil-minutes of training on the CPU)."""
    draft, _ = _sibling("distil_draft").distilled_draft(args.model, args.distilled_layers, args.distil_minutes,
                                                        threads=args.threads)
    return draft


if __name__ == "__main__":
    main()
