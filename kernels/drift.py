"""The drift correction's write: every candidate slot's cached K/V row plus its document's mean drift, in place.

``drift_correct(kpool, vpool, k, v, fresh_base, fresh_doc, slot_base, slot_doc, dst, n_docs, alpha)``. The rows
computed at a layer (``k``, ``v``: fresh pre-RoPE K/V) measure their document's drift from its cache (fresh minus
the cached row at ``fresh_base``); each slot ``s`` of a document ``d = slot_doc[s] >= 0`` gets
``pool[slot_base[s]] + alpha * mean(drift of d's computed rows)`` written to ``pool[dst[s]]`` (pool dtype), for K and
V; a document with no computed row keeps its cache. The mean is accumulated in float32.

Two versions, one rule (``dispatch``): the pure-torch reference (also the CPU path: a handful of index ops over every
slot per tensor) and a Triton version (CUDA): one program per computed row adds its drift into a per-document float32
table (atomics), then one program per slot reads its cached row and writes the corrected one, K and V in the same
launch. Slots of no document (``slot_doc < 0``) are left alone by the Triton version; the reference writes them
(cached plus document 0's drift) to their ``dst``, so point those at a row nothing reads. Destination rows must not
be rows some slot reads (``slot_base``) or some computed row's cached row (``fresh_base``).
"""
from __future__ import annotations

import torch

from .dispatch import choose_backend
from .scatter import scatter_rows_reference

__all__ = ["drift_correct", "drift_correct_reference", "drift_correct_triton"]


def _check(kpool, vpool, k, v, fresh_base, fresh_doc, slot_base, slot_doc, dst, n_docs: int) -> None:
    if kpool.dim() != 3 or tuple(vpool.shape) != tuple(kpool.shape):
        raise ValueError(f"kpool and vpool must be [rows, heads, head_dim] of one shape, got {tuple(kpool.shape)} "
                         f"and {tuple(vpool.shape)}")
    if k.dim() != 3 or tuple(v.shape) != tuple(k.shape) or tuple(k.shape[1:]) != tuple(kpool.shape[1:]):
        raise ValueError(f"k and v must be [A, {kpool.shape[1]}, {kpool.shape[2]}], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if kpool.dtype != vpool.dtype or k.dtype != v.dtype:
        raise ValueError("kpool and vpool (and k and v) must share a dtype")
    a, s = k.shape[0], slot_base.shape[0]
    for name, t, n in (("fresh_base", fresh_base, a), ("fresh_doc", fresh_doc, a), ("slot_doc", slot_doc, s),
                       ("dst", dst, s)):
        if t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"{name} must be [{n}], got {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must hold integers, got {t.dtype}")
    if slot_base.dim() != 1 or slot_base.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_base must be a 1-d integer tensor, got {tuple(slot_base.shape)} {slot_base.dtype}")
    if n_docs < 1:
        raise ValueError(f"n_docs must be >= 1, got {n_docs}")
    devs = {t.device for t in (kpool, vpool, k, v, fresh_base, fresh_doc, slot_base, slot_doc, dst)}
    if len(devs) != 1:
        raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devs))}")


def drift_correct_reference(kpool: torch.Tensor, vpool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            fresh_base: torch.Tensor, fresh_doc: torch.Tensor, slot_base: torch.Tensor,
                            slot_doc: torch.Tensor, dst: torch.Tensor, n_docs: int, alpha: float) -> None:
    """Pure-torch drift correction (also the CPU path).

    Args:
        kpool, vpool: [R, H, D] one layer's pools (cached rows read, corrected rows written in place).
        k, v: [A, H, D] fresh pre-RoPE K/V of the rows computed at this layer.
        fresh_base: [A] their cached rows; fresh_doc: [A] their document (-1: not a candidate document's row).
        slot_base: [S] the slots' cached rows; slot_doc: [S] their document (-1: none, see the module doc).
        dst: [S] rows the corrected K/V go to.
        n_docs: rows of the per-document table (> every document index).
        alpha: the share of the mean drift added.
    """
    _check(kpool, vpool, k, v, fresh_base, fresh_doc, slot_base, slot_doc, dst, n_docs)
    fresh_base, fresh_doc, slot_base, slot_doc, dst = (t.long() for t in (fresh_base, fresh_doc, slot_base,
                                                                           slot_doc, dst))
    mine = fresh_doc >= 0
    doc = fresh_doc.clamp_min(0)
    count = torch.zeros(n_docs, dtype=torch.float32, device=k.device).index_add_(0, doc, mine.float())
    scale = (float(alpha) / count.clamp_min(1.0))[:, None, None]
    slot_doc = slot_doc.clamp_min(0)
    for fresh, pool in ((k, kpool), (v, vpool)):
        # a computed row that is not a candidate reads whatever its cached row holds: masked, never multiplied
        delta = torch.where(mine[:, None, None], fresh.float() - pool.index_select(0, fresh_base).float(), 0.0)
        table = torch.zeros((n_docs, *fresh.shape[1:]), dtype=torch.float32, device=k.device)
        table.index_add_(0, doc, delta).mul_(scale)
        corrected = pool.index_select(0, slot_base).float() + table.index_select(0, slot_doc)
        scatter_rows_reference(pool, dst, corrected.to(pool.dtype))


def drift_correct_triton(kpool: torch.Tensor, vpool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         fresh_base: torch.Tensor, fresh_doc: torch.Tensor, slot_base: torch.Tensor,
                         slot_doc: torch.Tensor, dst: torch.Tensor, n_docs: int, alpha: float) -> None:
    """Triton drift correction; same contract as the reference (slots of no document are not written)."""
    _check(kpool, vpool, k, v, fresh_base, fresh_doc, slot_base, slot_doc, dst, n_docs)
    choose_backend(kpool.device, "triton")
    from ._triton.drift import launch

    launch(kpool, vpool, k, v, fresh_base, fresh_doc, slot_base, slot_doc, dst, n_docs, float(alpha))


def drift_correct(kpool: torch.Tensor, vpool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  fresh_base: torch.Tensor, fresh_doc: torch.Tensor, slot_base: torch.Tensor, slot_doc: torch.Tensor,
                  dst: torch.Tensor, n_docs: int, alpha: float, *, backend: str | None = None) -> None:
    """Writes every slot's drift-corrected K and V to its `dst` row (see the module doc and the reference's args).

    backend: None (the rule in ``dispatch``), ``"triton"`` or ``"torch"``."""
    if choose_backend(kpool.device, backend) == "triton":
        drift_correct_triton(kpool, vpool, k, v, fresh_base, fresh_doc, slot_base, slot_doc, dst, n_docs, alpha)
    else:
        drift_correct_reference(kpool, vpool, k, v, fresh_base, fresh_doc, slot_base, slot_doc, dst, n_docs, alpha)
