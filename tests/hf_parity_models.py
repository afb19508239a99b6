"""Seeded random Llama checkpoints with wide greedy margins, and the harness that
compares graphdecode with transformers on them (used by tests/gpu/test_gpu_hf_parity.py).

Why the weights are not plain random
------------------------------------
With i.i.d. random weights the logits of a position behave like V independent
Gaussians, and the gap between the two largest has a density that does not vanish at
zero: a few percent of positions have a top-2 gap below one bf16 ulp of the top logit.
Two correct bf16 implementations pick different tokens there (a different attention
kernel is enough: on such a model transformers' bf16 sdpa and eager attention disagree
on ~2% of argmaxes, bf16 and fp32 on 2-9%). Scaling the lm_head, the embeddings or
initializer_range does not help: the gap and the rounding noise scale together.

So the margin is planted. Every weight is drawn from a Generator seeded by
(spec seed, parameter name), so the checkpoint is the same whatever transformers
version builds it (checked: 5.17 and 5.24 save identical tensors), and then:

* embeddings are large (`embed_std`) next to what the layers add, so the last
  hidden state still points mostly along the current token's embedding;
* lm_head row i is the embedding of token perm[i], normalised (`logit_scale` is the
  logit that row gets from a hidden state equal to that embedding);
* q_proj/k_proj are drawn larger (`qk_std`), so attention is sharp enough that
  positions, hence the llama3 frequency scaling, matter.

The greedy token is then perm^-1(current token) at all but ~0.3-0.8% of positions
(where the context decides it), with top-2 gaps of several nats (1st percentile
0.3-0.8 nats on random text). The layers still move every logprob: zeroing the o_projs
moves the chosen token's logprob by 0.5-0.7 nats on average, dropping the llama3
scaling by 0.2-0.3. The consequence for tests: the argmax comparison holds across
correct bf16 kernels but is a weak bug detector; the logprob comparisons are the
sensitive ones. Continuations walk the permutation's cycles, so they are diverse.
`python tests/hf_parity_models.py [CPU_SMALL|GPU_D64|GPU_D128]` prints these
measurements (recipe_report) for the constants below.
"""

from __future__ import annotations

import gc
import os
import zlib
from dataclasses import dataclass, field

import torch

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # positions here reach ~150: frequencies with wavelengths above 64 are scaled by 1/8,
    # those between 16 and 64 are smoothed; both matter within the tested lengths
    "original_max_position_embeddings": 64,
}


@dataclass(frozen=True)
class Spec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    embed_std: float
    logit_scale: float
    init_std: float = 0.02
    qk_std: float = 0.02  # q_proj / k_proj: larger than init_std makes attention sharper, so positions matter
    seed: int = 0
    rope_scaling: dict = field(default_factory=lambda: dict(LLAMA3_ROPE))

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=1024,
            rope_theta=500000.0,
            rope_scaling=dict(self.rope_scaling),
            tie_word_embeddings=False,
            initializer_range=self.init_std,
            bos_token_id=1,
            eos_token_id=None,  # no EOS: transformers generates exactly max_new_tokens, like ignore_eos
            pad_token_id=None,
        )


# Shaped like real models: 8 query heads : 2 KV heads, head_dim 64 / 128, llama3 rope.
GPU_D64 = Spec(hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
               vocab_size=4096, embed_std=0.085, logit_scale=36.0, qk_std=0.06, seed=64)
GPU_D128 = Spec(hidden_size=1024, intermediate_size=2816, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=128,
                vocab_size=4096, embed_std=0.14, logit_scale=44.0, qk_std=0.042, seed=128)
# The CPU twin: the same recipe, small enough for CI on two cores.
CPU_SMALL = Spec(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=32,
                 vocab_size=2048, embed_std=0.025, logit_scale=16.0, qk_std=0.12, seed=7)


def _generator(spec: Spec, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(spec.seed * 1_000_003 + zlib.crc32(name.encode()))


def fill_weights(model, spec: Spec) -> None:
    """Overwrite every parameter from name-seeded generators, then plant the lm_head."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=_generator(spec, name)) * spec.embed_std)
            elif name != "lm_head.weight":
                std = spec.qk_std if name.endswith(("q_proj.weight", "k_proj.weight")) else spec.init_std
                p.copy_(torch.randn(p.shape, generator=_generator(spec, name)) * std)
        emb = params["model.embed_tokens.weight"].float()
        unit = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()  # unit rms rows, like the normed hidden state
        perm = planted_permutation(spec)
        params["lm_head.weight"].copy_(unit[perm] * (spec.logit_scale / spec.hidden_size))


def planted_permutation(spec: Spec) -> torch.Tensor:
    """perm[i] = the token whose embedding lm_head row i is: greedy mostly maps x to inverse(perm)[x]."""
    return torch.randperm(spec.vocab_size, generator=_generator(spec, "lm_head.permutation"))


def build_model(path: str, spec: Spec, dtype: torch.dtype = torch.bfloat16) -> str:
    """Save the spec's checkpoint in `dtype` with save_pretrained (no tokenizer: prompts are token ids)."""
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)  # transformers' own init runs first; every value is overwritten below
        model = AutoModelForCausalLM.from_config(spec.config())
    fill_weights(model, spec)
    model.to(dtype).save_pretrained(path)
    del model
    gc.collect()
    return path


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------- transformers side
def load_hf(path: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers generate, greedy, one prompt at a time (no padding), exactly max_new_tokens each."""
    device = next(model.parameters()).device
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)
            new = gen[0, len(p):].tolist()
            if len(new) != max_new_tokens:
                raise RuntimeError(f"transformers generated {len(new)} tokens, expected {max_new_tokens}")
            outs.append(new)
    return outs


def hf_logprobs(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """One teacher-forced forward of prompt + continuation: row j = log_softmax (float32, CPU)
    of the logits that predict continuation[j]."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + continuation], device=device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(continuation) - 1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def margins(logprob_rows: list[torch.Tensor]) -> dict:
    """top1 - top2 (nats; equal to the logit gap) and top-1 probability over all positions."""
    rows = torch.cat(logprob_rows)
    top = rows.topk(2, dim=-1).values
    gap = top[:, 0] - top[:, 1]
    return {
        "positions": int(gap.numel()),
        "gap_min": gap.min().item(),
        "gap_q01": gap.quantile(0.01).item(),
        "gap_median": gap.median().item(),
        "top1_prob_median": top[:, 0].exp().median().item(),
    }


# ----------------------------------------------------------------- graphdecode side
def engine_greedy(llm, prompts: list[list[int]], max_new_tokens: int, logprobs: int | None = None):
    """All prompts in one generate call, so they decode batched. Returns the token ids, and with
    `logprobs` also each token's logprob (what the engine reports for the chosen token)."""
    from graphdecode import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = [o.outputs[0].token_ids for o in outs]
    if logprobs is None:
        return tokens
    chosen = [[entry[t].logprob for t, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    return tokens, chosen


@dataclass
class TeacherForced:
    prefill_total: int = 0
    prefill_agree: int = 0
    decode_total: int = 0
    decode_agree: int = 0
    prefill_dlogprob: list = field(default_factory=list)
    decode_dlogprob: list = field(default_factory=list)
    disagreements: list = field(default_factory=list)  # (phase, prompt, position, ours, theirs, their gap)

    @property
    def prefill_agreement(self) -> float:
        return self.prefill_agree / max(self.prefill_total, 1)

    @property
    def decode_agreement(self) -> float:
        return self.decode_agree / max(self.decode_total, 1)

    @property
    def mean_abs_dlogprob(self) -> float:
        values = self.prefill_dlogprob + self.decode_dlogprob
        return sum(values) / max(len(values), 1)

    def summary(self) -> dict:
        return {
            "prefill_agreement": self.prefill_agreement,
            "prefill_positions": self.prefill_total,
            "decode_agreement": self.decode_agreement,
            "decode_positions": self.decode_total,
            "mean_abs_dlogprob": self.mean_abs_dlogprob,
            "mean_abs_dlogprob_prefill": sum(self.prefill_dlogprob) / max(len(self.prefill_dlogprob), 1),
            "mean_abs_dlogprob_decode": sum(self.decode_dlogprob) / max(len(self.decode_dlogprob), 1),
            "max_abs_dlogprob": max(self.prefill_dlogprob + self.decode_dlogprob, default=0.0),
        }


def _gap(row: torch.Tensor) -> float:
    top = row.topk(2).values
    return (top[0] - top[1]).item()


def teacher_force(llm, prompts: list[list[int]], continuations: list[list[int]],
                  reference: list[torch.Tensor]) -> TeacherForced:
    """Teacher-force the engine on transformers' greedy continuations.

    For each prompt P with continuation C and each j in 0..len(C)-2, the request
    P + C[:j] runs with max_tokens=2: its first token comes from our prefill and is
    compared with C[j]; when it agrees, the second token (the first step of a decode
    window, on P + C[:j+1]) is compared with C[j+1]. All requests go in one generate
    call, so decode runs batched. `reference[i][j]` is transformers' log_softmax
    predicting C[j] of prompt i (hf_logprobs); the chosen token's logprob is compared
    with it at every position whose context is the same on both sides.
    """
    from graphdecode import SamplingParams

    jobs = [(i, j) for i, c in enumerate(continuations) for j in range(len(c) - 1)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": prompts[i] + continuations[i][:j]} for i, j in jobs], params)
    result = TeacherForced()
    for (i, j), out in zip(jobs, outs):
        c, ref = continuations[i], reference[i]
        tokens, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
        assert len(tokens) == 2 and len(logprobs) == 2, (i, j, tokens)
        first = tokens[0]
        result.prefill_total += 1
        result.prefill_dlogprob.append(abs(logprobs[0][first].logprob - ref[j, first].item()))
        if first != c[j]:
            result.disagreements.append(("prefill", i, j, first, c[j], _gap(ref[j])))
            continue
        result.prefill_agree += 1
        second = tokens[1]
        result.decode_total += 1
        result.decode_dlogprob.append(abs(logprobs[1][second].logprob - ref[j + 1, second].item()))
        if second == c[j + 1]:
            result.decode_agree += 1
        else:
            result.disagreements.append(("decode", i, j + 1, second, c[j + 1], _gap(ref[j + 1])))
    return result


# ----------------------------------------------------------------- measuring the recipe
def recipe_report(spec: Spec, path: str, sequences: int = 16, length: int = 128) -> dict:
    """On random token sequences, transformers on CPU: how often two bf16 attention
    implementations (sdpa, eager) pick the same argmax, bf16 vs fp32, how much the
    attention path and the llama3 rope scaling move the argmax and the chosen logprob,
    and the margins."""
    import json
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, spec.vocab_size, (sequences, length), generator=g)
    logits = {}
    with tempfile.TemporaryDirectory() as tmp:
        plain = os.path.join(tmp, "plain_rope")  # the same weights without the llama3 frequency scaling
        shutil.copytree(path, plain)
        with open(os.path.join(plain, "config.json")) as f:
            raw = json.load(f)
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
        with open(os.path.join(plain, "config.json"), "w") as f:
            json.dump(raw, f)
        variants = (("sdpa", path, torch.bfloat16, "sdpa"), ("eager", path, torch.bfloat16, "eager"),
                    ("fp32", path, torch.float32, "sdpa"), ("no_attention", path, torch.float32, "sdpa"),
                    ("plain_rope", plain, torch.float32, "sdpa"))
        for name, where, dtype, impl in variants:
            model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation=impl).eval()
            if name == "no_attention":
                for layer in model.model.layers:
                    layer.self_attn.o_proj.weight.data.zero_()
            with torch.inference_mode():
                logits[name] = torch.log_softmax(model(ids).logits.float(), dim=-1)
            del model
    ref = logits["fp32"]
    chosen = ref.argmax(-1)
    inverse = torch.empty(spec.vocab_size, dtype=torch.long)
    inverse[planted_permutation(spec)] = torch.arange(spec.vocab_size)

    def agree(a, b):
        return (logits[a].argmax(-1) == logits[b].argmax(-1)).float().mean().item()

    def dlp(name):
        idx = chosen.unsqueeze(-1)
        return (ref.gather(-1, idx) - logits[name].gather(-1, idx)).abs().mean().item()

    report = {
        "agree_bf16_sdpa_vs_eager": agree("sdpa", "eager"),
        "agree_bf16_vs_fp32": agree("sdpa", "fp32"),
        "mean_abs_dlogprob_bf16_vs_fp32": dlp("sdpa"),
        "argmax_changed_without_attention": 1 - agree("fp32", "no_attention"),
        "mean_abs_dlogprob_without_attention": dlp("no_attention"),
        "argmax_changed_without_llama3_scaling": 1 - agree("fp32", "plain_rope"),
        "mean_abs_dlogprob_without_llama3_scaling": dlp("plain_rope"),
        "argmax_not_planted": (chosen != inverse[ids]).float().mean().item(),
        "distinct_argmax": int(chosen.unique().numel()),
    }
    report.update(margins([ref.reshape(-1, spec.vocab_size)]))
    return report


if __name__ == "__main__":
    import sys
    import tempfile

    torch.set_num_threads(1)
    names = sys.argv[1:] or ["CPU_SMALL", "GPU_D64", "GPU_D128"]
    for name in names:
        spec = globals()[name]
        with tempfile.TemporaryDirectory() as tmp:
            report = recipe_report(spec, build_model(os.path.join(tmp, name), spec))
        print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in report.items()}, flush=True)
