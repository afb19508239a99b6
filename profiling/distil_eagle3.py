"""Distil an EAGLE-3 head for a target on CPU, from the target's own generations.

The head (models/eagle3.py's format: `fc` over the target's hidden states entering layers (2, L // 2, L - 3),
one decoder layer over [normed token embedding | normed fused hidden state], a reduced draft vocabulary)
learns the target's greedy next-next token: at position i it reads the target's hidden states at i and the
token at i + 1, and is trained on the target's next-token distribution at i + 1 (cross-entropy against its top
32 probabilities inside the draft vocabulary). Training unrolls the drafting the
engine does (EAGLE-3's training-time test): at depth s > 1 the hidden state a query reads is the head's own
output one position back at depth s - 1, and it attends the exact (depth-1) K/V up to s - 1 positions back
and then the deeper K/V on the diagonal, as the window's drafting steps see them (device/draft_head.py).

Data: synthetic chat prompts (distil_draft.py's tasks and topics and more of each; the first --train-prompts of
them, the prompts held out for the acceptance report excluded), each answered by the target through the engine at
batch 128, greedy and at T=0.8; the target's hidden states and top-32 probabilities from transformers. In bfloat16
where the CPU computes it natively (avx512_bf16 or AMX), else in float32 (`native_bf16`). The data is most of the
cost (about 2 s a prompt on two AVX2 cores in fp32, 0.7 s on two Zen 4 cores in bf16), so it is cached apart from
the head (`target_data`; a run on fewer prompts reuses a larger run's, and a run on more generates only the rest).
Every --val-every-th prompt's greedy answer is held out: `validate` walks the engine's greedy rounds along it, which
gives the acceptance per verify at each d without the engine.

Training: the draft vocabulary is the --draft-vocab most frequent argmax tokens of the answers. The head embeds
with the target's embedding; its LM head starts from the target's rows, `fc` from passing the last hidden state
through. AdamW (under bfloat16 autocast where bf16 is native) for --minutes, on batches of answers of similar
length (`length_batches`), the learning rate warmed up and then cosine-decayed to a tenth over the budget. On a
CPU the head is bound by its steps more than its data (four depths at lr 1e-3 ended six minutes with their
training accuracy at the held-out one), so the defaults spend the steps where the engine uses them: depths 1 and 2
for d = 2 (each further depth costs more than the one before; two depths take 1.5x three's steps and 2x four's in
the same minutes), at 3e-3 (BENCHMARKS.md 10l).
Saved under the cache directory (eagle3/<target>-<hash>) and reused; then the acceptance on held-out prompts
(greedy, through the engine with `speculative_config={"method": "eagle3", ...}`, speculating every window).

    python profiling/distil_eagle3.py --threads 2 --out profiling/out/distil_eagle3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F

from graphdecode.bench.common import script_module

distil_draft = script_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "distil_draft.py"))

MORE_TOPICS = [
    "black holes", "the Roman Empire", "a job interview", "saving money", "climate change", "a village market",
    "artificial intelligence", "the immune system", "a road trip", "ancient Egypt", "coffee", "a first day at school",
    "volunteering", "earthquakes", "a jazz band", "the water cycle", "public libraries", "a pirate ship",
    "healthy breakfasts", "video games", "the Arctic", "a garden snail", "bridges", "the human brain",
    "a thunderstorm", "board games", "solar panels", "a small farm", "learning to swim", "dinosaurs",
    "the stock market", "a surprise party", "bicycles", "coral reefs", "a mystery novel", "the Olympic Games",
    "a family dinner", "vaccines", "an astronaut", "street food", "the Renaissance", "a broken phone",
    "meditation", "elephants", "a spelling bee", "airplanes", "the rainforest", "a new neighbour",
    "knitting", "the speed of light", "a busy hospital", "origami", "tornadoes", "a talking robot dog",
    "fast fashion", "the Great Wall of China", "a camping trip", "owls", "writing a resume", "the periodic table",
    "a magic shop", "social media", "glaciers", "a soccer match", "tea ceremonies", "the first computers",
    "a lost wallet", "butterflies", "city parks", "a snowy morning", "the French Revolution", "public speaking",
    "a treasure map", "recycling plastic", "sharks", "a school play", "wind turbines", "the Silk Road",
    "homemade bread", "a family pet", "the solar system", "a long train journey", "working from home",
    "mushrooms", "a kind stranger", "smartphones", "the Amazon river", "a science museum", "pizza",
    "the night sky", "a spaceship crew", "learning the guitar", "deserts at night", "a hot air balloon",
    "the Moon landing", "a quiet library", "octopuses", "an old map", "teamwork",
]
MORE_TASKS = [
    "Tell me a joke about {t}.", "Write a haiku about {t}.", "Summarize what you know about {t}.",
    "Why do people care about {t}?", "Write a dialogue between two friends about {t}.",
    "Give me a step-by-step guide related to {t}.", "What is a common misconception about {t}?",
    "Write a news headline and a short article about {t}.", "Compare {t} with something from everyday life.",
    "Write a product description inspired by {t}.",
]
ANSWER_TEMPERATURES = (0.0, 0.8)  # greedy (what the acceptance is measured on) and a seeded sampled answer
# at most about 30 minutes in all for SmolLM2-135M on two cores: 12 of training, the rest data (the prompts by the
# data's speed: fp32 on AVX2, ~2 s a prompt, BENCHMARKS.md 10l; native bf16 on a Zen 4, ~0.7 s a prompt, where
# 1,600 prompts did no better than 1,100 in 12 minutes of training, 10m)
MINUTES, DEPTHS, LR, BATCH = 12.0, 2, 3e-3, 8
TRAIN_PROMPTS_FP32, TRAIN_PROMPTS_BF16 = 600, 1100


def training_texts(held_out: int) -> list[str]:
    """distil_draft.py's prompts past the first `held_out`, then every other (task, topic) pair of both lists."""
    base = distil_draft.chat_texts()
    seen = set(base)
    more = [t for t in distil_draft.chat_texts(distil_draft.TASKS + MORE_TASKS, distil_draft.TOPICS + MORE_TOPICS)
            if t not in seen]
    return base[held_out:] + more


def training_prompts(target: str, held_out: int, count: int) -> list[list[int]]:
    """The first `count` training prompts (training_texts past `held_out`), chat-templated and tokenized."""
    from transformers import AutoTokenizer

    return distil_draft.chat_prompts(AutoTokenizer.from_pretrained(target), training_texts(held_out)[:count])


def data_dtype() -> torch.dtype:
    """The dtype of the target's answers and features and of the training: bf16 where native, else fp32."""
    return torch.bfloat16 if native_bf16() else torch.float32


def default_train_prompts() -> int:
    """The training prompts whose data fits the budget on this CPU: the data's dtype sets its speed."""
    return TRAIN_PROMPTS_BF16 if native_bf16() else TRAIN_PROMPTS_FP32


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (avx512_bf16 or AMX: the kernel library's pair panels). Elsewhere
    oneDNN emulates bf16 matmuls: transformers' forward of SmolLM2 on a 2-core AVX2 Zen 3 ran 70 tokens/s in bf16
    against 401 in fp32 (BENCHMARKS.md 10j), so the data, the features and the training run in fp32 there."""
    from graphdecode.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    return kernels is not None and kernels.bf16_pairs


def target_answers(target: str, prompts: list[list[int]], max_tokens: int, threads: int,
                   dtype: torch.dtype = torch.bfloat16) -> list[tuple]:
    """(prompt ids, answer ids): an answer per prompt at each of ANSWER_TEMPERATURES, through the engine
    (batch 128: the data is most of the budget)."""
    from graphdecode import LLM, SamplingParams

    llm = LLM(target, max_model_len=1024, max_batch_size=128, cpu_threads=threads,
              dtype=str(dtype).removeprefix("torch."))
    out = []
    for i, temperature in enumerate(ANSWER_TEMPERATURES):
        params = SamplingParams(temperature=temperature, seed=i if temperature else None, max_tokens=max_tokens)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
        out += [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    return out


def target_features(target: str, sequences: list[tuple], aux_layers: tuple[int, ...], top: int = 32,
                    batch: int = 8, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Per sequence: ids [T], aux [T, 3H] (the hidden states entering the aux layers, in `dtype`), the target's
    top `top` next-token probabilities and ids at each position [T, top], and the prompt length. Batches of
    similar length, right-padded (causal attention: padding changes nothing before it)."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    model.eval()
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]) + len(sequences[i][1]))
    out: list[dict | None] = [None] * len(sequences)
    with torch.inference_mode(), tqdm(total=len(sequences), desc="target hidden states") as bar:
        for start in range(0, len(order), batch):
            chunk = order[start : start + batch]
            seqs = [sequences[i][0] + sequences[i][1] for i in chunk]
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for b, s in enumerate(seqs):
                ids[b, : len(s)] = torch.tensor(s)
                mask[b, : len(s)] = 1
            result = model(ids, attention_mask=mask, output_hidden_states=True)
            probs, top_ids = result.logits.float().softmax(-1).topk(top, dim=-1)
            for b, i in enumerate(chunk):
                n = len(seqs[b])
                aux = torch.cat([result.hidden_states[layer][b, :n] for layer in aux_layers], dim=-1)
                out[i] = {"ids": ids[b, :n].clone(), "aux": aux.clone(), "top_p": probs[b, :n].clone(),
                          "top_ids": top_ids[b, :n].clone(), "prompt": len(sequences[i][0])}
            bar.update(len(chunk))
    return out


def temperature_blocks(items: list, prompts: int) -> list[list]:
    """Per-answer lists (one answer per prompt at each of ANSWER_TEMPERATURES, in that order) cut into each
    temperature's block of `prompts` answers."""
    return [items[t * prompts : (t + 1) * prompts] for t in range(len(ANSWER_TEMPERATURES))]


def target_data(target: str, prompts: list[list[int]], max_tokens: int, threads: int, dtype: torch.dtype,
                aux_layers: tuple[int, ...]) -> dict:
    """The target's answers to `prompts` and their features (target_answers, target_features): most of a head's
    cost, so cached under the cache directory (eagle3-data/) apart from the head. Heads trained with other
    settings reuse them; a run on the first n prompts of a cached run's takes those prompts' answers and features
    (the seconds they took scaled by the share of prompts, `scaled_from` saying so), and a run on more prompts
    than a cached run's first ones generates only the rest (`extended_from`; the larger entry replaces the
    smaller). An extension is the data one run would have made: the engine's outputs do not depend on their batch
    company (greedy, and seeded sampling's position-keyed noise)."""
    from graphdecode.cache import cache_root

    key = hashlib.sha256(json.dumps([os.path.abspath(target), max_tokens, ANSWER_TEMPERATURES, str(dtype),
                                     list(aux_layers), "top32"]).encode()).hexdigest()[:12]
    folder = os.path.join(cache_root(), "eagle3-data", f"{os.path.basename(os.path.normpath(target))}-{key}")
    os.makedirs(folder, exist_ok=True)
    prefix, prefix_name = [], None  # the largest cached run whose prompts are the first of these
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        cached = json.load(open(os.path.join(folder, name)))
        if cached[: len(prompts)] != prompts:
            if len(prefix) < len(cached) < len(prompts) and prompts[: len(cached)] == cached:
                prefix, prefix_name = cached, name
            continue
        data = torch.load(os.path.join(folder, name.removesuffix(".json") + ".pt"))
        n, whole = len(prompts), len(cached)
        if n < whole:  # each temperature's block of answers, cut to the first n prompts'
            for field in ("sequences", "features"):
                data[field] = [x for block in temperature_blocks(data[field], whole) for x in block[:n]]
            for field in ("generate_seconds", "features_seconds"):
                data[field] *= n / whole
            data["scaled_from"] = whole
        return data
    rest = prompts[len(prefix):]
    start = time.perf_counter()
    sequences = target_answers(target, rest, max_tokens, threads, dtype)
    generate_s = time.perf_counter() - start
    start = time.perf_counter()
    features = target_features(target, sequences, aux_layers, dtype=dtype)
    data = {"sequences": sequences, "features": features, "generate_seconds": generate_s,
            "features_seconds": time.perf_counter() - start}
    if prefix_name is not None:  # each temperature's block: the cached prompts' answers, then the rest's
        old_path = os.path.join(folder, prefix_name.removesuffix(".json"))
        old = torch.load(old_path + ".pt")
        for field in ("sequences", "features"):
            pairs = zip(temperature_blocks(old[field], len(prefix)), temperature_blocks(data[field], len(rest)))
            data[field] = [x for cached, added in pairs for x in cached + added]
        for field in ("generate_seconds", "features_seconds"):
            data[field] += old[field]
    path = os.path.join(folder, f"{len(prompts)}-{hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:10]}")
    torch.save(data, path + ".tmp")
    os.replace(path + ".tmp", path + ".pt")
    json.dump(prompts, open(path + ".json", "w"))  # last: a listed entry's data is whole
    if prefix_name is not None:  # its prompts and data are the new entry's first
        os.remove(old_path + ".json")
        os.remove(old_path + ".pt")
        data["extended_from"] = len(prefix)  # this run's, not the entry's
    return data


class TrainHead(torch.nn.Module):
    """The head's math (models/eagle3.py) over whole sequences, with EAGLE-3's unrolled drafting depths."""

    def __init__(self, cfg: dict, embed: torch.Tensor, draft_ids: torch.Tensor, eps: float):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads", heads)
        self.dim = cfg.get("head_dim") or hidden // heads
        self.heads, self.kv_heads, self.eps = heads, kv_heads, eps
        inter = cfg["intermediate_size"]
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**cfg))
        self.embed = embed  # frozen: the target's

        def linear(out_features, in_features, std=0.02):
            return torch.nn.Parameter(torch.randn(out_features, in_features) * std)

        fc = torch.zeros(hidden, 3 * hidden)
        fc[:, 2 * hidden:] = torch.eye(hidden)  # start by passing the last hidden state through
        self.w = torch.nn.ParameterDict({name.replace(".", "__"): p for name, p in {
            "fc.weight": torch.nn.Parameter(fc),
            "midlayer.self_attn.q_proj.weight": linear(heads * self.dim, 2 * hidden),
            "midlayer.self_attn.k_proj.weight": linear(kv_heads * self.dim, 2 * hidden),
            "midlayer.self_attn.v_proj.weight": linear(kv_heads * self.dim, 2 * hidden),
            "midlayer.self_attn.o_proj.weight": torch.nn.Parameter(torch.zeros(hidden, heads * self.dim)),
            "midlayer.mlp.gate_proj.weight": linear(inter, hidden),
            "midlayer.mlp.up_proj.weight": linear(inter, hidden),
            "midlayer.mlp.down_proj.weight": torch.nn.Parameter(torch.zeros(hidden, inter)),
            "midlayer.input_layernorm.weight": torch.nn.Parameter(torch.ones(hidden)),
            "midlayer.hidden_norm.weight": torch.nn.Parameter(torch.ones(hidden)),
            "midlayer.post_attention_layernorm.weight": torch.nn.Parameter(torch.ones(hidden)),
            "norm.weight": torch.nn.Parameter(torch.ones(hidden)),
            "lm_head.weight": torch.nn.Parameter(embed[draft_ids].clone()),
        }.items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name.replace("__", "."): p.detach() for name, p in self.w.items()}

    def p(self, name: str) -> torch.Tensor:
        return self.w[name.replace(".", "__")]

    def rms(self, x, name):
        x = x.float()  # in fp32 under autocast, as the engine computes it
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.p(name)

    def forward(self, aux, next_ids, depths: int) -> list[torch.Tensor]:
        """aux [B, T, 3H], next_ids [B, T] (the token after each position) -> logits [B, T, N] per depth."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        B, T, _ = aux.shape
        w = self.p
        embeds = self.rms(self.embed[next_ids], "midlayer.input_layernorm.weight")
        hidden = aux @ w("fc.weight").T
        cos, sin = self.rotary(hidden, torch.arange(T)[None].expand(B, T))
        keys, values, logits = [], [], []
        group = self.heads // self.kv_heads
        scale = self.dim ** -0.5
        causal = torch.arange(T)[None, :] <= torch.arange(T)[:, None]  # [T(query), T(key)]
        out = hidden
        for s in range(depths):
            if s:  # the head's own output one position back, at the depth before
                hidden = F.pad(out[:, :-1], (0, 0, 1, 0))
            residual = hidden
            x = torch.cat([embeds, self.rms(hidden, "midlayer.hidden_norm.weight")], dim=-1)
            q = (x @ w("midlayer.self_attn.q_proj.weight").T).view(B, T, self.heads, self.dim).transpose(1, 2)
            k = (x @ w("midlayer.self_attn.k_proj.weight").T).view(B, T, self.kv_heads, self.dim).transpose(1, 2)
            v = (x @ w("midlayer.self_attn.v_proj.weight").T).view(B, T, self.kv_heads, self.dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, h, T, D]
            keys.append(k)
            values.append(v)
            # depth-1 keys up to s positions back, then depth m's key s - m positions back (m = 1..s)
            first = (q @ keys[0].transpose(-1, -2)) * scale
            first = first.masked_fill(~causal.tril(-s), float("-inf"))
            diagonal = [((q * F.pad(keys[m], (0, 0, s - m, 0))[:, :, :T]).sum(-1) * scale)[..., None]
                        for m in range(1, s + 1)]
            weights = torch.cat([first, *diagonal], dim=-1).softmax(-1)
            attn = weights[..., :T] @ values[0]
            for m in range(1, s + 1):
                attn = attn + weights[..., T + m - 1 : T + m] * F.pad(values[m], (0, 0, s - m, 0))[:, :, :T]
            attn = attn.transpose(1, 2).reshape(B, T, -1) @ w("midlayer.self_attn.o_proj.weight").T
            residual = residual + attn
            normed = self.rms(residual, "midlayer.post_attention_layernorm.weight")
            mlp = (F.silu(normed @ w("midlayer.mlp.gate_proj.weight").T) * (normed @ w("midlayer.mlp.up_proj.weight").T))
            out = residual + mlp @ w("midlayer.mlp.down_proj.weight").T
            logits.append(self.rms(out, "norm.weight") @ w("lm_head.weight").T)
        return logits


@torch.no_grad()
def validate(model: TrainHead, validation: list[dict], draft_of: torch.Tensor, depths: int) -> dict:
    """The head on held-out greedy answers, as the engine drafts along them: each depth's accuracy against the
    target's argmax, and the drafts a greedy verify accepts per round at d = 1..depths, the rounds walked along
    each answer (draft j of a round at q is depth j's prediction at q + j - 1; the round accepts the drafts
    before the first wrong one, and the next starts past them and the verify's own token). On greedy answers
    the unrolled depths compute exactly what the window's drafting steps do, so this is the acceptance the
    engine measures, without the engine."""
    right, counted = [0] * depths, [0] * depths
    accepted, rounds = [0] * depths, [0] * depths
    for f in validation:
        n = len(f["ids"]) - 1
        outs = model(f["aux"][None, :n].float(), f["ids"][None, 1:], depths)
        labels = draft_of[f["top_ids"][1:, 0]][:n]
        hit = torch.stack([(o[0].argmax(-1) == labels) & (labels >= 0) for o in outs])  # [depths, n]
        first = f["prompt"] - 1  # the first round drafts from the prompt's last position
        for s in range(depths):
            right[s] += int(hit[s, first + s:].sum())
            counted[s] += max(n - first - s, 0)
        hits = hit.tolist()
        for d in range(1, depths + 1):
            q = first
            while q + d <= n:
                a = 0
                while a < d and hits[a][q + a]:
                    a += 1
                accepted[d - 1] += a
                rounds[d - 1] += 1
                q += a + 1
    return {"depth_accuracy": [round(r / max(c, 1), 4) for r, c in zip(right, counted)],
            "accepted_per_verify": [round(a / max(r, 1), 4) for a, r in zip(accepted, rounds)],
            "sequences": len(validation)}


def draft_of_size(draft_of: torch.Tensor) -> int:
    return int(draft_of.max()) + 1


def length_batches(features: list[dict], batch: int, rng: random.Random):
    """Endless batches of `batch` sequences of similar length (a step pads to its longest sequence): each epoch
    the sequences sorted by length (ties broken at random), cut into batches, the batches shuffled."""
    while True:
        ranked = sorted(range(len(features)), key=lambda i: (len(features[i]["ids"]), rng.random()))
        chunks = [ranked[i : i + batch] for i in range(0, len(ranked), batch)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield [features[i] for i in chunk]


def train(features: list[dict], model: TrainHead, draft_of: torch.Tensor, minutes: float, batch: int, lr: float,
          depths: int, autocast: bool = True) -> dict:
    from tqdm import tqdm

    params = list(model.w.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    batches = length_batches(features, batch, random.Random(1))
    steps, losses, accuracy = 0, [], []
    deadline = time.monotonic() + minutes * 60
    with tqdm(total=int(minutes * 60), unit="s", desc="distilling the EAGLE-3 head") as bar:
        started = time.monotonic()
        while time.monotonic() < deadline:
            chosen = next(batches)
            width = max(len(f["ids"]) for f in chosen) - 1
            aux = torch.zeros(len(chosen), width, chosen[0]["aux"].shape[1], dtype=chosen[0]["aux"].dtype)
            next_ids = torch.zeros(len(chosen), width, dtype=torch.long)
            labels = torch.full((len(chosen), width), -100, dtype=torch.long)
            soft = torch.zeros(len(chosen), width, draft_of_size(draft_of))
            for b, f in enumerate(chosen):
                n = len(f["ids"]) - 1
                aux[b, :n] = f["aux"][:n]
                next_ids[b, :n] = f["ids"][1:]
                first = max(f["prompt"] - 2, 0)  # the answer's tokens (and the one before it)
                # position i predicts the target's distribution at i + 1 (its top entries in the draft vocabulary)
                labels[b, first:n] = draft_of[f["top_ids"][1:, 0]][first:n]
                ids, probs = draft_of[f["top_ids"][1:]], f["top_p"][1:]  # [n, top]
                rows = torch.arange(n)[:, None].expand_as(ids)
                keep = (ids >= 0) & (rows >= first)
                soft[b, rows[keep], ids[keep]] = probs[keep]
            done = min((time.monotonic() - started) / (minutes * 60), 1.0)
            for g in optimizer.param_groups:  # warm-up, then a cosine down to a tenth at the deadline
                g["lr"] = lr * min(1.0, (steps + 1) / 50) * (0.55 + 0.45 * math.cos(math.pi * done))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                outs = model(aux.float(), next_ids, depths)
            loss = 0.0
            valid = labels != -100
            for s, logits in enumerate(outs):
                use = valid.clone()
                use[:, :s] = False  # no s earlier positions to draft from
                # cross-entropy against the target's distribution (its top entries), not only its argmax
                nll = -(soft * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
                loss = loss + 0.8**s * nll[use].mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            steps += 1
            losses.append(loss.item())
            with torch.no_grad():
                valid = labels != -100
                accuracy.append(float((outs[0].argmax(-1) == labels)[valid].float().mean()))
            bar.n = min(int(time.monotonic() - started), bar.total)
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}",
                            acc1=f"{sum(accuracy[-10:]) / len(accuracy[-10:]):.3f}", steps=steps)
    return {"steps": steps, "first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:]),
            "depth1_accuracy_last": sum(accuracy[-10:]) / len(accuracy[-10:])}


def distilled_head(target: str, minutes: float = MINUTES, *, draft_vocab: int = 4096, max_tokens: int = 160,
                   batch: int = BATCH, lr: float = LR, depths: int = DEPTHS, threads: int | None = None,
                   val_every: int = 32, eval_prompts: int | None = None,
                   train_prompts: int | None = None) -> tuple[str, dict]:
    """(the head's directory, its training report); built once per (target, settings). `train_prompts`: the
    first this many training prompts (default_train_prompts when None)."""
    from transformers import AutoModelForCausalLM

    from graphdecode.cache import cache_root
    from graphdecode.config import _resolve_cpu_threads
    from graphdecode.models.eagle3_checkpoint import head_config, save_eagle3_head
    from graphdecode.models.model_config import load_model_config

    threads = threads or _resolve_cpu_threads(None, 1)
    train_prompts = train_prompts or default_train_prompts()
    held_out = distil_draft.EVAL_PROMPTS if eval_prompts is None else eval_prompts
    dtype = data_dtype()
    settings = (f"{os.path.abspath(target)}|{minutes}|{draft_vocab}|{max_tokens}|{batch}|{lr}|{depths}|{held_out}|"
                f"{train_prompts}|soft32|{ANSWER_TEMPERATURES}|more-prompts|val{val_every}|"
                f"{'bf16' if dtype == torch.bfloat16 else 'fp32'}")
    name = f"{os.path.basename(os.path.normpath(target))}-{minutes:g}min-{hashlib.sha256(settings.encode()).hexdigest()[:10]}"
    path = os.path.join(cache_root(), "eagle3", name)
    report_path = os.path.join(path, "distil_report.json")
    if os.path.isfile(report_path):
        return path, json.load(open(report_path))
    torch.set_num_threads(threads)
    target_config = load_model_config(target)
    layers = target_config.decoder_layers
    aux_layers = (2, layers // 2, layers - 3)  # vLLM's default; a shallow target's last three instead
    if len(set(aux_layers)) < 3 or min(aux_layers) < 0:
        aux_layers = (layers - 3, layers - 2, layers - 1)
    prompts = training_prompts(target, held_out, train_prompts)
    data = target_data(target, prompts, max_tokens, threads, dtype, aux_layers)
    sequences, features = data["sequences"], data["features"]
    # every val_every-th prompt's greedy answer is held out (both its answers leave the training set)
    held = [i % val_every == val_every - 1 for i in range(len(prompts))] * len(ANSWER_TEMPERATURES)
    validation = [f for f, h in zip(features[: len(prompts)], held) if h]  # the first block: greedy answers
    features = [f for f, h in zip(features, held) if not h]
    counts = torch.bincount(torch.cat([f["top_ids"][f["prompt"]:, 0] for f in features]),
                            minlength=target_config.vocab_size)
    draft_ids = counts.topk(draft_vocab).indices.sort().values
    coverage = float(counts[draft_ids].sum() / counts.sum())
    draft_of = torch.full((counts.numel(),), -100, dtype=torch.long)
    draft_of[draft_ids] = torch.arange(draft_vocab)
    config = head_config(target, draft_vocab_size=draft_vocab, aux_layers=aux_layers)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    embed = hf.model.embed_tokens.weight.detach().clone()
    del hf
    model = TrainHead(config, embed, draft_ids, config.get("rms_norm_eps", 1e-6))
    report = train(features, model, draft_of, minutes, batch, lr, depths, autocast=dtype == torch.bfloat16)
    report["validation"] = validate(model, validation, draft_of, depths) if validation else None
    report.update(dtype=str(dtype), generate_seconds=data["generate_seconds"], features_seconds=data["features_seconds"],
                  data_scaled_from=data.get("scaled_from"), data_extended_from=data.get("extended_from"),
                  sequences=len(sequences), training_sequences=len(features),
                  tokens=sum(len(p) + len(a) for p, a in sequences), answer_tokens=sum(len(a) for _, a in sequences),
                  draft_vocab=draft_vocab, draft_vocab_coverage=coverage, aux_layers=list(aux_layers),
                  minutes=minutes, depths=depths)
    tmp = path + ".building"
    shutil.rmtree(tmp, ignore_errors=True)
    save_eagle3_head(tmp, config, model.tensors(), draft_ids)
    return distil_draft.publish(tmp, path, report)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the target's directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--minutes", type=float, default=MINUTES, help="training time budget")
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=160, help="answer length the target generates per prompt")
    p.add_argument("--depths", type=int, default=DEPTHS, help="drafting depths unrolled in training")
    p.add_argument("--lr", type=float, default=LR, help="AdamW's peak learning rate")
    p.add_argument("--batch", type=int, default=BATCH, help="sequences per training step")
    p.add_argument("--val-every", type=int, default=32,
                   help="every N-th training prompt's greedy answer is held out for the validation report")
    p.add_argument("--train-prompts", type=int, default=None,
                   help=f"the first this many training prompts (default: {TRAIN_PROMPTS_FP32} where the data runs in "
                        f"float32, {TRAIN_PROMPTS_BF16} where bf16 is native)")
    p.add_argument("-d", type=int, default=DEPTHS, help="num_speculative_tokens for the acceptance report")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="profiling/out/distil_eagle3")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    if args.model is None:
        from graphdecode.gguf_import import smollm2_dir

        args.model = smollm2_dir()
    head, report = distilled_head(args.model, args.minutes, draft_vocab=args.draft_vocab, max_tokens=args.max_tokens,
                                  depths=args.depths, threads=args.threads, train_prompts=args.train_prompts,
                                  lr=args.lr, batch=args.batch, val_every=args.val_every)
    eval_prompts = distil_draft.chat_prompts(AutoTokenizer.from_pretrained(args.model))[: distil_draft.EVAL_PROMPTS]
    threads = args.threads or torch.get_num_threads()
    result = {"bench": "distil_eagle3", "target": args.model, "head": head, "report": report,
              "acceptance": distil_draft.acceptance(args.model, head, eval_prompts, args.d, 128, threads,
                                                    method="eagle3")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    json.dump(result, open(args.out + ".json", "w"), indent=1)
    a = result["acceptance"]
    print(f"EAGLE-3 head: {a['accepted_per_verify']:.2f} accepted per verify of {args.d}, "
          f"{a['accepted_per_draft']:.1%} of drafts (training: {report})")
    print(f"head: {head}")
    return result


if __name__ == "__main__":
    main()
