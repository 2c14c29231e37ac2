"""Attention over fused KV rows with deferred RoPE and a causal mask by ABSOLUTE position.

``fused_attention(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale) -> [M, Hq, D]``

- q [M, Hq, D]: queries, RoPE already applied; q_pos [M] int64 their absolute positions.
- k, v [R, Hkv, D]: a pool of rows (e.g. cached documents used in place); k holds keys BEFORE RoPE.
- kv_rows [N] int64: the pool rows to attend to, in any order (None: rows 0..N-1).
- kv_pos [N] int64: the absolute position of each of those keys (None: key j sits at position j, N being
  len(kv_rows), or the pool's rows when kv_rows is None too); RoPE at kv_pos is applied to the keys as they
  are read (deferred RoPE: the cache itself is never rotated or copied; with many query rows the Triton path
  rotates the attended keys once into a transient per-call buffer instead of once per query block, with the same
  bits). cos/sin [P, D] are tables indexed by position, in HF's layout (both halves of a row equal; model dtype
  saves bandwidth, results are the same); cos=None means the keys are already rotated.
- Mask: key j is visible to query i iff ``kv_pos[j] <= q_pos[i]``. This is NOT a bottom-right aligned causal
  mask: a recomputed token in the middle of the prompt sees only keys at or before its own position.
  With kv_pos None (the fused prefills' case: slot p holds position p) the Triton kernels compute each key's
  position and the keys a query block can see instead of reading kv_pos and searching it in every program.
- GQA: Hq % Hkv == 0, q head h reads kv head ``h // (Hq // Hkv)``.
- Softmax accumulates in fp32; the output has q's dtype. A query that sees no key gets zeros.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import choose_backend
from .rope import rope_in_dtype

__all__ = ["fused_attention", "fused_attention_reference", "fused_attention_triton", "gather_keys", "key_count",
           "positions"]


def check_inputs(q, q_pos, k, v, kv_rows, kv_pos, cos, sin):
    """Validates shapes and dtypes shared by the attention ops; returns (q_pos, kv_rows, kv_pos) as int64.

    `v` may be None (attention scores need no values).
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [tokens, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    m, hq, d = q.shape
    _, hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"q and k head_dim differ: {d} vs {dk}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    if v is not None and tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.dtype != q.dtype or (v is not None and v.dtype != q.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {None if v is None else v.dtype}")
    if q_pos.dim() != 1 or q_pos.numel() != m:
        raise ValueError(f"q_pos must be [M={m}], got {tuple(q_pos.shape)}")
    if kv_pos is None:  # key j at position j: N from the rows attended to
        if kv_rows is not None and kv_rows.dim() != 1:
            raise ValueError(f"kv_rows must be [N], got {tuple(kv_rows.shape)}")
        n = key_count(k, kv_rows, None)
    elif kv_pos.dim() != 1:
        raise ValueError(f"kv_pos must be [N], got {tuple(kv_pos.shape)}")
    else:
        n = kv_pos.numel()
    if kv_rows is not None:
        if tuple(kv_rows.shape) != (n,):
            raise ValueError(f"kv_rows must be [N={n}], got {tuple(kv_rows.shape)}")
        kv_rows = kv_rows.long()
    elif n > k.shape[0]:
        raise ValueError(f"kv_rows=None uses rows 0..N-1 but the pool has only {k.shape[0]} rows (N={n})")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin must both be given or both be None")
    devices = {t.device for t in (q, q_pos, k, v, kv_rows, kv_pos, cos, sin) if t is not None}
    if len(devices) != 1:  # a clear error here, never a wild read in a kernel
        raise ValueError(f"attention inputs must share one device, got {sorted(map(str, devices))}")
    if cos is not None:
        if d % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {d}")
        for name, table in (("cos", cos), ("sin", sin)):
            if table.dim() != 2 or table.shape[1] != d:
                raise ValueError(f"{name} must be [positions, head_dim={d}], got {tuple(table.shape)}")
    return q_pos.long(), kv_rows, None if kv_pos is None else kv_pos.long()


def key_count(k: torch.Tensor, kv_rows: torch.Tensor | None, kv_pos: torch.Tensor | None) -> int:
    """N: the number of keys attended to."""
    if kv_pos is not None:
        return kv_pos.numel()
    return kv_rows.numel() if kv_rows is not None else k.shape[0]


def positions(k: torch.Tensor, kv_rows: torch.Tensor | None, kv_pos: torch.Tensor | None) -> torch.Tensor:
    """kv_pos as a tensor: the given one, or 0..N-1 when None (key j at position j)."""
    if kv_pos is not None:
        return kv_pos
    return torch.arange(key_count(k, kv_rows, None), device=k.device)


def gather_keys(k: torch.Tensor, kv_rows: torch.Tensor | None, kv_pos: torch.Tensor,
                cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
    """The keys attended to, head-major and rotated: [Hkv, N, D] in k's dtype (HF RoPE arithmetic)."""
    n = kv_pos.numel()
    heads_first = k.transpose(0, 1)                                        # [Hkv, R, D] view
    keys = heads_first[:, :n] if kv_rows is None else torch.index_select(heads_first, 1, kv_rows)
    if cos is None:
        return keys
    return rope_in_dtype(keys, cos[kv_pos], sin[kv_pos])                  # cos[kv_pos]: [N, D] broadcast


def gather_values(v: torch.Tensor, kv_rows: torch.Tensor | None, n: int) -> torch.Tensor:
    """[Hkv, N, D] values of the attended rows."""
    heads_first = v.transpose(0, 1)
    return heads_first[:, :n] if kv_rows is None else torch.index_select(heads_first, 1, kv_rows)


def mask_kind(q_pos: torch.Tensor, kv_pos: torch.Tensor) -> str:
    """How ``kv_pos[j] <= q_pos[i]`` can be expressed: "all" (every key visible), "causal" (exactly SDPA's
    top-left causal mask, as in a full prefill) or "explicit" (a boolean mask is needed)."""
    if kv_pos.numel() == 0 or q_pos.numel() == 0:
        return "explicit"
    if int(q_pos.min()) >= int(kv_pos.max()):
        return "all"
    m, n = q_pos.numel(), kv_pos.numel()
    if m <= n and bool((kv_pos[1:] > kv_pos[:-1]).all()):
        visible = torch.searchsorted(kv_pos, q_pos, right=True)
        if torch.equal(visible, torch.arange(1, m + 1, device=q_pos.device)):
            return "causal"
    return "explicit"


def fused_attention_reference(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale):
    """Pure-torch fused attention (also the CPU path). Same contract as the module docstring.

    Gathers and rotates the keys once ([Hkv, N, D]), then one SDPA call with GQA (K is not repeated per q head)
    and the absolute-position mask; the mask is dropped or replaced by ``is_causal`` when equivalent.
    """
    q_pos, kv_rows, kv_pos = check_inputs(q, q_pos, k, v, kv_rows, kv_pos, cos, sin)
    kv_pos = positions(k, kv_rows, kv_pos)
    m, hq, d = q.shape
    n = kv_pos.numel()
    if m == 0 or n == 0:
        return q.new_zeros((m, hq, d))
    keys = gather_keys(k, kv_rows, kv_pos, cos, sin)                      # [Hkv, N, D]
    values = gather_values(v, kv_rows, n)                                  # [Hkv, N, D]
    kind = mask_kind(q_pos, kv_pos)
    mask = kv_pos[None, :] <= q_pos[:, None] if kind == "explicit" else None   # [M, N] bool
    gqa = hq != k.shape[1]
    if gqa and mask is not None and q.device.type != "cpu":
        # the fused GPU kernels that take a mask do not take GQA: repeat the kv heads rather than fall to math
        keys = keys.repeat_interleave(hq // k.shape[1], dim=0)
        values = values.repeat_interleave(hq // k.shape[1], dim=0)
        gqa = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, is_causal=kind == "causal",
        scale=scale, enable_gqa=gqa)[0]                                    # [Hq, M, D]
    blind = q_pos < kv_pos.min()                                           # queries that see no key
    if bool(blind.any()):
        out = out.masked_fill(blind[None, :, None], 0.0)
    return out.transpose(0, 1).contiguous()


def fused_attention_triton(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale):
    """Triton fused attention (flash-style, deferred RoPE, GQA heads packed per kv head); same contract as the
    reference."""
    q_pos, kv_rows, kv_pos = check_inputs(q, q_pos, k, v, kv_rows, kv_pos, cos, sin)
    choose_backend(q.device, "triton")
    from ._triton.attention import launch

    return launch(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale)


def fused_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_rows: torch.Tensor | None, kv_pos: torch.Tensor | None, cos: torch.Tensor | None,
                    sin: torch.Tensor | None, scale: float, *, backend: str | None = None) -> torch.Tensor:
    """Attention of q over the selected pool rows, RoPE applied to keys on load, masked by absolute position.

    Args:
        q: [M, Hq, D] queries, RoPE applied.
        q_pos: [M] int64 absolute positions of the queries.
        k: [R, Hkv, D] key pool, BEFORE RoPE (or already rotated when cos is None).
        v: [R, Hkv, D] value pool.
        kv_rows: [N] int64 pool rows to attend to, any order; None for rows 0..N-1.
        kv_pos: [N] int64 absolute positions of those keys; None when key j sits at position j (N = len(kv_rows),
            or the pool's rows R with kv_rows None too): the same result, without reading or searching positions.
        cos: [P, D] cos table indexed by position (halves duplicated), or None.
        sin: [P, D] sin table, or None.
        scale: softmax scale (usually head_dim ** -0.5).
        backend: None (the rule in ``dispatch``), ``"triton"`` or ``"torch"``.

    Returns:
        [M, Hq, D] in q's dtype; key j contributes to query i iff ``kv_pos[j] <= q_pos[i]``.
    """
    if choose_backend(q.device, backend) == "triton":
        return fused_attention_triton(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale)
    return fused_attention_reference(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale)
