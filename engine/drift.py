"""The drift correction's arithmetic, shared by the eager layer loop (runner.py) and the shape-bucket graphs
(bucketed.py): a strategy's `drift` option (fusion/base.py `make_strategy`).

From a strategy's `drift_layer` on, a cached document row drifts from its cached K/V because the full prompt's
other documents change its context. The rows computed at a layer measure that drift (fresh minus cached K/V); every
candidate slot gets its cached row plus `alpha` x the mean drift of its own document's computed rows (a document
with none keeps its cache). The callers write the corrected rows to the request's own rows (never the shared cache)
before the fresh rows go over theirs, so a computed row keeps its fresh K/V. Pure tensor work, no host read.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.scatter import scatter_rows

__all__ = ["write_corrected"]


def write_corrected(kpool: Tensor, vpool: Tensor, k: Tensor, v: Tensor, fresh_base: Tensor, fresh_doc: Tensor,
                    slot_base: Tensor, slot_doc: Tensor, dst: Tensor, n_docs: int, alpha: float) -> None:
    """Writes every slot's corrected K and V (pool dtype) to pool rows `dst`.

    Args:
        kpool, vpool: one layer's pools of rows (cached rows are read at `*_base`, corrected ones written at `dst`).
        k, v: [A, kv_heads, head_dim] fresh pre-RoPE K/V of the rows computed at this layer.
        fresh_base: [A] their cached rows; fresh_doc: [A] their document (-1: not a candidate document row).
        slot_base: [S] the slots' cached rows; slot_doc: [S] their document (a slot of -1 gets document 0's drift:
            point its `dst` at a row nothing reads).
        n_docs: rows of the per-document table (>= every document index + 1).
    """
    mine = fresh_doc >= 0
    doc = fresh_doc.clamp_min(0)
    count = torch.zeros(n_docs, dtype=torch.float32, device=k.device).index_add_(0, doc, mine.float())
    scale = (alpha / count.clamp_min(1.0))[:, None, None]
    slot_doc = slot_doc.clamp_min(0)
    for fresh, pool in ((k, kpool), (v, vpool)):
        # a computed row that is not a candidate reads whatever its cached row holds: masked, never multiplied
        delta = torch.where(mine[:, None, None], fresh.float() - pool.index_select(0, fresh_base).float(), 0.0)
        table = torch.zeros((n_docs, *fresh.shape[1:]), dtype=torch.float32, device=k.device)
        table.index_add_(0, doc, delta).mul_(scale)
        corrected = pool.index_select(0, slot_base).float() + table.index_select(0, slot_doc)
        scatter_rows(pool, dst, corrected.to(pool.dtype))
