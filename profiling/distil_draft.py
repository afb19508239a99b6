"""Distil a small draft model for speculative decoding from the target's own generations, on CPU.

The draft is the target's first L decoder layers with its embeddings, final norm and LM head (a
layer-truncated copy: the same tokenizer and vocabulary, so `method: draft_model` takes it), trained
on sequences the target generated itself: its greedy and sampled (T=0.7) answers to synthetic chat
prompts, so the draft learns the target's next token in the target's own contexts. The embeddings
(and a tied head) stay frozen; the L layers and the final norm train with AdamW for a time budget,
the loss on the answers' tokens only. The draft is saved as a HuggingFace checkpoint under the cache
directory (drafts/<target>-L<layers>-<minutes>min-<hash>) and reused by later runs.

It then reports the acceptance on held-out prompts (greedy, through the engine with
`speculative_config={"method": "draft_model", ...}`), beside the untrained truncated copy's.

    python profiling/distil_draft.py --layers 4 --minutes 20 --out profiling/out/distil_draft
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import shutil
import time

import torch

TOPICS = ["dragons", "the ocean", "volcanoes", "a small bakery", "learning to code", "the moon", "honeybees",
          "a rainy city", "chess", "friendship", "trains", "mountain hiking", "the history of paper", "robots",
          "gardening", "a lost cat", "music lessons", "the desert", "recycling", "a birthday party", "photosynthesis",
          "space travel", "an old lighthouse", "winter sports", "the internet", "a detective", "rivers", "kindness",
          "a science fair", "electric cars", "a haunted house", "sleep", "the printing press", "penguins",
          "a marathon", "cooking pasta", "clouds", "a museum visit", "time management", "wolves"]
EVAL_PROMPTS = 16  # the first prompts of chat_prompts() are held out for the acceptance report
TASKS = ["Write a short story about {t}.", "Explain {t} to a ten-year-old.", "List three interesting facts about {t}.",
         "Write a short poem about {t}.", "What are the pros and cons of {t}?", "Describe {t} in a few sentences.",
         "Give me some advice related to {t}.", "Write a friendly email to a colleague about {t}."]


def chat_texts(tasks: list[str] = TASKS, topics: list[str] = TOPICS) -> list[str]:
    """Every (task, topic) pair, in a fixed shuffled order."""
    texts = [task.format(t=topic) for task, topic in itertools.product(tasks, topics)]
    random.Random(0).shuffle(texts)
    return texts


def chat_prompts(tokenizer, texts: list[str] | None = None) -> list[list[int]]:
    """`texts` (default: chat_texts()) as chat-templated prompts."""
    out = []
    for text in chat_texts() if texts is None else texts:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def truncated_draft(target: str, layers: int, out: str) -> None:
    """The target's first `layers` decoder layers, embeddings, final norm and head, as a checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    if not 1 <= layers < model.config.num_hidden_layers:
        raise ValueError(f"--layers must be between 1 and {model.config.num_hidden_layers - 1}, got {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out)
    for name in os.listdir(target):  # the tokenizer's files
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(os.path.join(target, name), os.path.join(out, name))


def target_sequences(target: str, prompts: list[list[int]], max_tokens: int, threads: int) -> list[tuple]:
    """(prompt ids, answer ids) per prompt: greedy for even prompts, T=0.7 (seeded) for odd ones."""
    from graphdecode import LLM, SamplingParams

    llm = LLM(target, max_model_len=1024, max_batch_size=64, cpu_threads=threads)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    warm = SamplingParams(temperature=0.7, seed=1, max_tokens=max_tokens)
    params = [greedy if i % 2 == 0 else warm for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]


def train(draft_dir: str, sequences: list[tuple], minutes: float, batch: int, lr: float) -> dict:
    """AdamW on the draft's layers and final norm (embeddings and a tied head frozen) for `minutes`,
    cross-entropy on the answers' tokens; saves the result over `draft_dir`."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    model.train()
    for p in model.model.embed_tokens.parameters():
        p.requires_grad_(False)
    if not model.config.tie_word_embeddings:
        model.lm_head.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    order = random.Random(1)
    steps, tokens, losses = 0, 0, []
    deadline = time.monotonic() + minutes * 60
    with tqdm(total=int(minutes * 60), unit="s", desc="distilling the draft") as bar:
        started = time.monotonic()
        while time.monotonic() < deadline:
            chosen = order.sample(sequences, min(batch, len(sequences)))
            width = max(len(p) + len(a) for p, a in chosen)
            ids = torch.zeros(len(chosen), width, dtype=torch.long)
            labels = torch.full((len(chosen), width), -100, dtype=torch.long)
            mask = torch.zeros(len(chosen), width, dtype=torch.long)
            for i, (p, a) in enumerate(chosen):
                seq = p + a
                ids[i, : len(seq)] = torch.tensor(seq)
                labels[i, len(p) : len(seq)] = torch.tensor(a)
                mask[i, : len(seq)] = 1
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            steps += 1
            tokens += int((labels != -100).sum())
            losses.append(loss.item())
            bar.n = min(int(time.monotonic() - started), bar.total)
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}", steps=steps)
    model.save_pretrained(draft_dir)
    return {"steps": steps, "answer_tokens": tokens, "first_loss": losses[0], "last_loss": sum(losses[-10:]) /
            len(losses[-10:])}


def acceptance(target: str, draft: str, prompts: list[list[int]], d: int, max_tokens: int, threads: int,
               method: str = "draft_model") -> dict:
    """Greedy through the engine with the draft (or an EAGLE-3 head: method "eagle3"), speculating every window:
    drafts accepted per verify, per draft, and at each draft position per verify."""
    from graphdecode import LLM, SamplingParams

    llm = LLM(target, max_model_len=1024, max_batch_size=64, cpu_threads=threads,
              speculative_config={"method": method, "model": draft, "num_speculative_tokens": d})
    llm.engine.spec_policy.speculate = lambda bucket, rows=(): True  # measure the draft, not the policy
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens))
    s = llm.stats()
    verifies = max(s["spec_verifies"], 1)
    return {"accepted_per_verify": s["spec_accepted_tokens"] / verifies,
            "accepted_per_draft": s["spec_accepted_tokens"] / max(s["spec_draft_tokens"], 1),
            "accepted_per_position": [round(c / verifies, 3) for c in s["spec_accepted_per_position"]]}


def distilled_draft(target: str, layers: int, minutes: float, *, prompts: list[list[int]] | None = None,
                    max_tokens: int = 128, batch: int = 8, lr: float = 3e-4, threads: int | None = None) -> tuple:
    """(the distilled draft's directory, its training report); built once per (target, layers, minutes),
    on `prompts` (default: chat_prompts() past the held-out ones)."""
    from graphdecode.cache import cache_root
    from graphdecode.config import _resolve_cpu_threads

    threads = threads or _resolve_cpu_threads(None, 1)
    key = hashlib.sha256(f"{os.path.abspath(target)}|{layers}|{minutes}|{max_tokens}|{batch}|{lr}".encode())
    name = f"{os.path.basename(os.path.normpath(target))}-L{layers}-{minutes:g}min-{key.hexdigest()[:10]}"
    path = os.path.join(cache_root(), "drafts", name)
    report_path = os.path.join(path, "distil_report.json")
    if os.path.isfile(report_path):
        return path, json.load(open(report_path))
    if prompts is None:
        from transformers import AutoTokenizer

        prompts = chat_prompts(AutoTokenizer.from_pretrained(target))[EVAL_PROMPTS:]
    tmp = path + ".building"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    truncated_draft(target, layers, tmp)
    torch.set_num_threads(threads)
    start = time.perf_counter()
    sequences = target_sequences(target, prompts, max_tokens, threads)
    generate_s = time.perf_counter() - start
    report = train(tmp, sequences, minutes, batch, lr)
    report.update(generate_seconds=generate_s, sequences=len(sequences), layers=layers, minutes=minutes)
    return publish(tmp, path, report)


def publish(tmp: str, path: str, report: dict) -> tuple[str, dict]:
    """The checkpoint built in `tmp`, with its report, moved to `path` (the cache entry later runs reuse)."""
    json.dump(report, open(os.path.join(tmp, "distil_report.json"), "w"), indent=1)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path, report


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the target's directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers the draft keeps")
    p.add_argument("--minutes", type=float, default=20.0, help="training time budget")
    p.add_argument("--max-tokens", type=int, default=128, help="answer length the target generates per prompt")
    p.add_argument("--eval-prompts", type=int, default=EVAL_PROMPTS)
    p.add_argument("-d", type=int, default=4, help="num_speculative_tokens for the acceptance report")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="profiling/out/distil_draft")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    if args.model is None:
        from graphdecode.gguf_import import smollm2_dir

        args.model = smollm2_dir()
    prompts = chat_prompts(AutoTokenizer.from_pretrained(args.model))
    train_prompts, eval_prompts = prompts[args.eval_prompts :], prompts[: args.eval_prompts]
    draft, report = distilled_draft(args.model, args.layers, args.minutes, prompts=train_prompts,
                                    max_tokens=args.max_tokens, threads=args.threads)
    untrained = draft + ".untrained"
    if not os.path.isdir(untrained):
        truncated_draft(args.model, args.layers, untrained)
    threads = args.threads or torch.get_num_threads()
    result = {"bench": "distil_draft", "target": args.model, "draft": draft, "report": report,
              "untrained": acceptance(args.model, untrained, eval_prompts, args.d, args.max_tokens, threads),
              "distilled": acceptance(args.model, draft, eval_prompts, args.d, args.max_tokens, threads)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    json.dump(result, open(args.out + ".json", "w"), indent=1)
    for name in ("untrained", "distilled"):
        a = result[name]
        print(f"{name:>10}: {a['accepted_per_verify']:.2f} accepted per verify of {args.d}, "
              f"{a['accepted_per_draft']:.1%} of drafts")
    print(f"draft: {draft}")
    return result


if __name__ == "__main__":
    main()
