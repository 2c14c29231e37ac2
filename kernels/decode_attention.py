"""Batched decode attention: one new query per sequence, each over its own keys, read through a row map.

``decode_attention(q, q_pos, k, v, row_map, cos, sin, scale) -> [B, Hq, D]``

- q [B, Hq, D]: one query per sequence, RoPE applied; q_pos [B] int64 its position (the sequence's last).
- k, v [R, Hkv, D]: one arena of rows shared by every sequence (a document's rows are read in place by every
  sequence that uses it); k holds keys BEFORE RoPE.
- row_map [B, C] int64: sequence b's key at position p lives in row ``row_map[b, p]``; positions
  ``p <= q_pos[b]`` are attended to, the rest are ignored (they must name a row of the arena; what it holds,
  even NaN, never reaches the output).
- cos/sin [P, D] (P > max q_pos): RoPE tables indexed by position (HF layout); a key is rotated at its position
  as it is read (deferred RoPE), so shared rows are never rotated in place or copied.
- GQA: Hq % Hkv == 0, q head h reads kv head ``h // (Hq // Hkv)``. Softmax in fp32; output in q's dtype.

The shapes depend only on (B, C), never on the sequences' lengths: a CUDA graph of a decode step captured for a
batch bucket replays for any lengths <= C.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import choose_backend
from .rope import rope_in_dtype

__all__ = ["decode_attention", "decode_attention_reference", "decode_attention_triton"]


def check_inputs(q, q_pos, k, v, row_map, cos, sin) -> None:
    """Shapes, dtypes and devices at the dispatch boundary: a clear error, never a wild read."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [rows, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    b, hq, d = q.shape
    if k.shape[2] != d or k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree (head_dim, or Hq % Hkv != 0)")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if row_map.dim() != 2 or row_map.shape[0] != b or row_map.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_map must be [B={b}, C] int32/int64, got {tuple(row_map.shape)} {row_map.dtype}")
    if q_pos.shape != (b,) or q_pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"q_pos must be [B={b}] int32/int64, got {tuple(q_pos.shape)} {q_pos.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != d or t.shape[0] < row_map.shape[1]:
            raise ValueError(f"{name} must be [P >= C={row_map.shape[1]}, head_dim={d}], got {tuple(t.shape)}")
    devices = {t.device for t in (q, q_pos, k, v, row_map, cos, sin)}
    if len(devices) != 1:
        raise ValueError(f"decode_attention inputs must share one device, got {sorted(map(str, devices))}")


def decode_attention_reference(q, q_pos, k, v, row_map, cos, sin, scale):
    """Pure torch (also the CPU path): gathers each sequence's keys [B, Hkv, C, D], rotates them at their
    positions, one masked SDPA call with GQA."""
    check_inputs(q, q_pos, k, v, row_map, cos, sin)
    b, hq, d = q.shape
    c = row_map.shape[1]
    rows = row_map.long()
    visible = torch.arange(c, device=q.device)[None, :] <= q_pos.long()[:, None]   # [B, C]
    hidden = ~visible[:, :, None, None]
    keys = k[rows].masked_fill(hidden, 0).transpose(1, 2)          # [B, Hkv, C, D]; rows not yet written: 0
    keys = rope_in_dtype(keys, cos[:c], sin[:c])                   # position p = column p
    values = v[rows].masked_fill(hidden, 0).transpose(1, 2)        # [B, Hkv, C, D]
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=visible[:, None, None, :],
                                         scale=scale, enable_gqa=hq != k.shape[1])  # [B, Hq, 1, D]
    return out[:, :, 0, :]


def decode_attention_triton(q, q_pos, k, v, row_map, cos, sin, scale, **overrides):
    """Triton flash-decoding over the row map (keys split across programs, partial softmaxes merged)."""
    check_inputs(q, q_pos, k, v, row_map, cos, sin)
    choose_backend(q.device, "triton")
    from ._triton.decode_attention import launch

    return launch(q, q_pos, k, v, row_map, cos, sin, scale, **overrides)


def decode_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_map: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, scale: float, *, backend: str | None = None
                     ) -> torch.Tensor:
    """One decode step's attention for a batch of sequences (see the module docstring).

    Args:
        q: [B, Hq, D] RoPE applied. q_pos: [B] positions. k, v: [R, Hkv, D] arena (k before RoPE).
        row_map: [B, C] rows of each sequence's positions 0..C-1. cos, sin: [P >= C, D]. scale: softmax scale.
        backend: None (the rule in ``dispatch``), ``"triton"`` or ``"torch"``.
    Returns:
        [B, Hq, D] in q's dtype.
    """
    if choose_backend(q.device, backend) == "triton":
        return decode_attention_triton(q, q_pos, k, v, row_map, cos, sin, scale)
    return decode_attention_reference(q, q_pos, k, v, row_map, cos, sin, scale)
