"""Hand-built SelectContexts for the strategy unit tests: a prefix, a few documents, a question, and random
question attention (rows are causal softmax distributions over all keys) that tests can plant peaks into."""
from __future__ import annotations

import torch

from kvfuse.engine.fusion.base import SelectContext

PREFIX = 6
DOC_LENS = (20, 30, 25)
Q = 5


def layout(doc_lens=DOC_LENS, prefix=PREFIX, q=Q):
    spans, pos = [], prefix
    for n in doc_lens:
        spans.append((pos, pos + n))
        pos += n
    question = torch.arange(pos, pos + q)
    return spans, question, pos + q


def random_attention(n_rows: int, question: torch.Tensor, n: int, gen: torch.Generator, scale: float = 0.01):
    """[Q, N] causal rows summing to 1: small random mass everywhere visible, most of it on position 0 (the
    prefix's sink, as real models do)."""
    att = torch.rand(n_rows, n, generator=gen) * scale
    att[:, 0] = 1.0
    for r, p in enumerate(question.tolist()):
        att[r, p + 1:] = 0.0
    return att / att.sum(dim=1, keepdim=True)


def make_ctx(n_layers=12, layers=None, ratio=0.2, seed=0, doc_lens=DOC_LENS, extras=None, q=Q):
    """A context with question attention at `layers` (default: every layer)."""
    spans, question, n = layout(doc_lens, q=q)
    gen = torch.Generator().manual_seed(seed)
    layers = range(n_layers) if layers is None else layers
    qa = {int(i): random_attention(question.numel(), question, n, gen) for i in layers}
    cand = torch.cat([torch.arange(s, e) for s, e in spans])
    return SelectContext(n_layers=n_layers, ratio=ratio, candidates=cand, doc_spans=spans, question=question,
                         question_attention=qa, doc_extras=extras if extras is not None else [{} for _ in spans])


def plant(ctx: SelectContext, layer: int, pos: int, value: float, rows=None) -> None:
    """Gives key `pos` attention `value` from the given question rows (all by default) at `layer`, taking it from
    the sink so rows still sum to 1."""
    att = ctx.question_attention[layer]
    rows = range(att.shape[0]) if rows is None else rows
    for r in rows:
        att[r, pos] += value
        att[r, 0] -= value
    assert bool((att >= 0).all())


def check_selection(ctx: SelectContext, chosen: torch.Tensor) -> None:
    """Sorted, unique, int64 candidates, exactly the budget."""
    assert chosen.dtype == torch.long
    assert chosen.numel() == ctx.budget, (chosen.numel(), ctx.budget)
    assert bool((chosen[1:] > chosen[:-1]).all()), "not sorted unique"
    assert bool(torch.isin(chosen, ctx.candidates).all()), "picked a non-candidate"


def assert_planted_selected(name: str, ratio: float, planted: list[int], value: float) -> None:
    """Plants `value` of question attention on `planted` at every probe layer of strategy `name`; its initial
    choice must keep the exact budget (check_selection) and contain every planted position."""
    from kvfuse.engine.fusion import make_strategy

    ctx = make_ctx(ratio=ratio)
    s = make_strategy(name)
    planted = planted[: max(1, ctx.budget)]
    for layer in s.probe_layers(ctx.n_layers):
        for p in planted:
            plant(ctx, layer, p, value)
    chosen = s.initial(ctx)
    check_selection(ctx, chosen)
    assert set(planted) <= set(chosen.tolist())
