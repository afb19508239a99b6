"""min_p, top_k and top_p over a window's tempered logits: each keeps a prefix of the tokens by descending
probability (min_p those at least min_p times the most likely, top_k the first k, top_p those whose
probability before them, renormalised over what min_p and top_k kept, is below top_p), so what is kept is the
shortest of the three prefixes; the rest become -inf. top_k = 0, top_p = 1 and min_p = 0 cut nothing.

Sorting a row of the vocabulary to find those prefixes costs a CPU about 2 ms (49,152 tokens): 30 ms a step at
16 rows, more than the step's forward (BENCHMARKS.md 18v). The kept prefix is short in practice (a chat model
at T = 0.7 and top_p = 0.95 keeps tens of tokens), so an eager CPU window finds it among each row's `width`
most likely tokens (a partial selection, 20 times cheaper than the sort) and sorts only the rows whose prefix
reaches past them. In a graph (a GPU's, or a compiled window) the shapes are static: every row is sorted.
"""

from __future__ import annotations

import torch

WIDTH = 256  # the candidates an eager CPU window looks for a row's kept prefix among


def filter_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  width: int | None = None, live: torch.Tensor | None = None) -> torch.Tensor:
    """scaled [R, V] tempered logits; top_k [R] (0: off), top_p [R], min_p [R]: the logits with the tokens the
    three filters cut at -inf (`width`: the candidates, default WIDTH; the vocabulary's size sorts every row).
    `live` [R] bool: the rows whose token is read; the others are never sorted (a done row's or an inert
    query's logits are zeros, a flat row whose top_p prefix is most of the vocabulary)."""
    width = WIDTH if width is None else width
    if scaled.device.type != "cpu" or torch.compiler.is_compiling() or width >= scaled.shape[-1]:
        return filter_sorted(scaled, top_k, top_p, min_p)
    out, unresolved = _filter_candidates(scaled, top_k, top_p, min_p, width)
    if live is not None:
        unresolved &= live
    if unresolved.any():  # rows whose kept prefix reaches past the candidates: sorted, alone
        rows = unresolved.nonzero()[:, 0]
        out[rows] = filter_sorted(scaled[rows], top_k[rows], top_p[rows], min_p[rows])
    return out


def filter_sorted(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """The filters over each row sorted whole (static shapes: what a graph runs)."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    keep = ranks < torch.where(top_k > 0, top_k, vocab)[:, None]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    kept = torch.where(keep, probs, 0.0)
    before = kept.cumsum(dim=-1) - kept
    keep &= (before < top_p[:, None] * kept.sum(dim=-1, keepdim=True)) | (top_p[:, None] >= 1)
    mask = torch.zeros_like(keep).scatter(1, order, keep)
    return scaled.masked_fill(~mask, float("-inf"))


def _filter_candidates(scaled, top_k, top_p, min_p, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The filters from each row's `width` most likely tokens, and which rows they do not settle: those whose
    top_k reaches past the candidates ahead of min_p's cut, or whose top_p cut lies past them. (Where min_p's
    cut comes first, its prefix is every token above its threshold, found without an order, as is the mass
    top_p renormalises over.)"""
    vocab = scaled.shape[-1]
    probs = torch.softmax(scaled, dim=-1)
    top_probs, top_ids = probs.topk(width, dim=-1)  # [R, W], descending
    above = probs >= (min_p * top_probs[:, 0])[:, None]  # min_p's prefix, unordered
    n_min_p = above.sum(dim=-1)
    k = torch.where(top_k > 0, top_k.to(n_min_p.dtype), vocab)
    limit = torch.minimum(k, n_min_p)  # the prefix min_p and top_k keep
    ranks = torch.arange(width, device=scaled.device)[None, :]
    kept = torch.where(ranks < limit[:, None], top_probs, 0.0)
    total = torch.where(limit <= width, kept.sum(dim=-1), torch.where(above, probs, 0.0).sum(dim=-1))
    before = kept.cumsum(dim=-1) - kept
    n_top_p = ((before < (top_p * total)[:, None]) & (ranks < limit[:, None])).sum(dim=-1)
    cuts_p = top_p < 1
    length = torch.where(cuts_p, torch.minimum(limit, n_top_p), limit)
    # settled: the kept prefix lies among the candidates, or it is min_p's (found unordered); and the mass
    # top_p renormalises over is known (top_k does not cut past the candidates)
    past = limit > width
    unresolved = past & ((k < n_min_p) | (cuts_p & (n_top_p >= width)))
    first = torch.zeros_like(above).scatter(1, top_ids, ranks < length[:, None])
    keep = torch.where((length > width)[:, None], above, first)
    return scaled.masked_fill(~keep, float("-inf")), unresolved
