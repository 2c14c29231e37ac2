"""Attention probabilities of a few query rows over the fused keys, averaged over q heads.

``attention_scores(q, q_pos, k, kv_rows, kv_pos, cos, sin, scale) -> [M, N] float32``

Same inputs, deferred RoPE and absolute-position mask as :func:`kvfuse.kernels.attention.fused_attention`
(no values needed). Entry ``[i, j]`` is the softmax probability of key j for query i, averaged over the Hq
heads; each row sums to 1 (0 for a query that sees no key). Query-aware selection (InfoFlow, ProphetKV,
QCFuse) reduces it over the question rows.

``attention_and_scores(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale) -> ([M, Hq, D], [M, N] float32)``: the
attention output (`fused_attention`) and these scores of the same queries over the same keys, as a probe layer
needs both. The Triton path normalises the scores by the attention kernel's own softmax statistics, so the
scores' statistics pass (a second read of every key) is not run.
"""
from __future__ import annotations

import torch

from .attention import check_inputs, fused_attention_reference, gather_keys, positions
from .dispatch import choose_backend

__all__ = ["attention_and_scores", "attention_scores", "attention_scores_reference", "attention_scores_triton"]

# The reference materialises [heads, M, N] fp32 probabilities a few kv heads at a time, within this budget.
_REFERENCE_CHUNK_BYTES = 64 * 2**20


def attention_scores_reference(q, q_pos, k, kv_rows, kv_pos, cos, sin, scale):
    """Pure-torch attention scores (also the CPU path): fp32 scores per kv-head group, softmax, mean over heads."""
    q_pos, kv_rows, kv_pos = check_inputs(q, q_pos, k, None, kv_rows, kv_pos, cos, sin)
    kv_pos = positions(k, kv_rows, kv_pos)
    m, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    n = kv_pos.numel()
    out = torch.zeros((m, n), dtype=torch.float32, device=q.device)
    if m == 0 or n == 0:
        return out
    keys = gather_keys(k, kv_rows, kv_pos, cos, sin).float()             # [Hkv, N, D]
    queries = q.float().view(m, hkv, group, d).permute(1, 2, 0, 3)       # [Hkv, G, M, D]
    hidden = kv_pos[None, :] > q_pos[:, None]                             # [M, N] True = masked out
    per_kv_head = group * m * n * 4
    step = max(1, _REFERENCE_CHUNK_BYTES // max(per_kv_head, 1))
    for h0 in range(0, hkv, step):
        h1 = min(hkv, h0 + step)
        s = torch.matmul(queries[h0:h1], keys[h0:h1, None].transpose(-1, -2)) * scale   # [h, G, M, N]
        s.masked_fill_(hidden, float("-inf"))
        out += torch.softmax(s, dim=-1).sum(dim=(0, 1))
    out /= hq
    blind = q_pos < kv_pos.min()                                          # softmax of nothing is NaN -> 0
    if bool(blind.any()):
        out.masked_fill_(blind[:, None], 0.0)
    return out


def attention_scores_triton(q, q_pos, k, kv_rows, kv_pos, cos, sin, scale):
    """Triton attention scores: a stats pass (row max and sum per head) and a pass that writes the normalised
    probabilities summed over heads; never materialises [Hq, M, N]. Same contract as the reference."""
    q_pos, kv_rows, kv_pos = check_inputs(q, q_pos, k, None, kv_rows, kv_pos, cos, sin)
    choose_backend(q.device, "triton")
    from ._triton.attn_scores import launch

    return launch(q, q_pos, k, kv_rows, kv_pos, cos, sin, scale)


def attention_scores(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, kv_rows: torch.Tensor | None,
                     kv_pos: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None, scale: float, *,
                     backend: str | None = None) -> torch.Tensor:
    """Softmax probabilities of each query over the keys, averaged over q heads.

    Args:
        q: [M, Hq, D] queries, RoPE applied.
        q_pos: [M] int64 absolute positions.
        k: [R, Hkv, D] key pool, before RoPE (already rotated when cos is None).
        kv_rows: [N] int64 pool rows, any order; None for rows 0..N-1.
        kv_pos: [N] int64 key positions; key j visible to query i iff ``kv_pos[j] <= q_pos[i]``. None: key j at
            position j (N = len(kv_rows), or R with kv_rows None), as in `fused_attention`.
        cos: [P, D] table indexed by position, or None.
        sin: [P, D] table, or None.
        scale: softmax scale.
        backend: None (the rule in ``dispatch``), ``"triton"`` or ``"torch"``.

    Returns:
        [M, N] float32; rows sum to 1 (0 for a query that sees no key).
    """
    if choose_backend(q.device, backend) == "triton":
        return attention_scores_triton(q, q_pos, k, kv_rows, kv_pos, cos, sin, scale)
    return attention_scores_reference(q, q_pos, k, kv_rows, kv_pos, cos, sin, scale)


def attention_and_scores(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_rows: torch.Tensor | None, kv_pos: torch.Tensor | None, cos: torch.Tensor | None,
                         sin: torch.Tensor | None, scale: float, *,
                         backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(`fused_attention(...)`, `attention_scores(...)`) of the same arguments in one call. On the Triton path the
    scores reuse the attention kernel's softmax statistics (row max and sum per query and q head, merged over
    its key splits) instead of a statistics pass of their own; the result is the two calls' up to fp32 rounding of the
    normalisation."""
    if choose_backend(q.device, backend) != "triton":
        return (fused_attention_reference(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale),
                attention_scores_reference(q, q_pos, k, kv_rows, kv_pos, cos, sin, scale))
    q_pos, kv_rows, kv_pos = check_inputs(q, q_pos, k, v, kv_rows, kv_pos, cos, sin)
    from ._triton.attention import launch as attend
    from ._triton.attn_scores import launch as score

    out, stats = attend(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale, stats=True)
    return out, score(q, q_pos, k, kv_rows, kv_pos, cos, sin, scale, stats=stats)
