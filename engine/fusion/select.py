"""The selection-only pass: a strategy's probe and `initial` over a prepared prompt, and nothing after.

Used to reorder documents for strategies with `reorders_documents` (`reorder_documents`), and by offline
profilers that only need the probe's attention (engine/profile.py). The runner is an argument: nothing here
imports it.
"""
from __future__ import annotations

from .base import SelectContext, Strategy

__all__ = ["select_only", "reorder_documents"]


class _Stop(Exception):
    def __init__(self, ctx: SelectContext, chosen) -> None:
        super().__init__("selection done")
        self.ctx, self.chosen = ctx, chosen


class _SelectOnly(Strategy):
    """Wraps a strategy: same probe, then stops the prefill right after `initial` (nothing else is computed)."""

    def __init__(self, inner: Strategy) -> None:
        self.inner = inner

    def probe_layers(self, n_layers: int):
        return self.inner.probe_layers(n_layers)

    def probe_keys(self, ctx: SelectContext):
        return self.inner.probe_keys(ctx)

    def initial(self, ctx: SelectContext):
        raise _Stop(ctx, self.inner.initial(ctx))


def select_only(runner, ids, segments, strategy: Strategy, ratio: float):
    """(ctx, chosen) of `strategy` over a prepared prompt: its probe and `initial`, no fused prefill.

    Args:
        runner: the Runner; ids: [N] token ids; segments: as `Runner.prefill` takes them.
    Returns:
        (SelectContext, chosen positions), or (None, None) when the prompt has no cached segment (nothing to
        select from).
    """
    try:
        runner.prefill(ids, segments, _SelectOnly(strategy), ratio, want_logits=False)
    except _Stop as stop:
        return stop.ctx, stop.chosen
    return None, None


def reorder_documents(runner, layout, segments, docs, strategy, ratio):
    """The documents in the order `strategy.document_order` asks for after one selection pass over `layout`.

    Documents the strategy cannot see (not cached) keep their relative order, ahead of the others.
    """
    ctx, chosen = select_only(runner, layout.ids, segments, strategy, ratio)
    if ctx is None or len(ctx.doc_spans) < 2:
        return list(docs)
    by_start = {sp.start: i for i, sp in enumerate(layout.docs)}
    moved = [by_start[ctx.doc_spans[j][0]] for j in strategy.document_order(ctx, chosen)]
    seen = set(moved)
    return [docs[i] for i in range(len(docs)) if i not in seen] + [docs[i] for i in moved]
