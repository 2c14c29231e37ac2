"""Block-sparse causal attention of a whole prompt: SIFT-style sparse prefill.

``block_sparse_attention(q[T,Hq,D], k[T,Hkv,D], v[T,Hkv,D], block_lists, block_counts, block_size, scale)
-> [T,Hq,D]``

Every prompt token is computed, but the queries of block b (rows ``b*block_size .. min((b+1)*block_size, T)-1``)
attend only to the keys of the key blocks listed for b:

- block_lists [NB, M] int32/int64, NB = ceil(T / block_size): row b holds the key blocks of query block b, strictly
  ascending, in its first ``block_counts[b]`` entries; the rest of the row is padding (any value, never read).
- block_counts [NB] int32/int64: 1 <= block_counts[b] <= M.
- Or lists per KV head: block_lists [Hkv, NB, M] and block_counts [Hkv, NB]; the q heads of KV head g (GQA) read
  row [g, b]. Same rules per head.
- The diagonal block b must be listed in row b (every query then sees at least itself). Listed blocks after b are
  allowed and change nothing: within listed blocks attention is causal by row index, key j is visible to query i
  iff j <= i and the block of j is listed for the block of i. Keys of unlisted blocks are never seen.
- q and k have RoPE applied (rows are positions 0..T-1). GQA: Hq % Hkv == 0, q head h reads kv head
  ``h // (Hq // Hkv)``. Softmax in fp32 (the Triton kernel) / SDPA's own precision (the torch reference); the
  output is in q's dtype.

The lists are checked at the dispatch boundary (range, order, diagonal): a clear ValueError, never a wild read.
On CUDA that check costs one host sync per call (a few tiny reductions, then one read of their result).
"""
from __future__ import annotations

import torch

from .causal import token_major_sdpa
from .dispatch import choose_backend

__all__ = ["block_sparse_attention", "block_sparse_attention_reference", "block_sparse_attention_triton",
           "dense_block_lists", "mask_from_block_lists"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _n_blocks(t: int, block_size: int) -> int:
    return -(-t // block_size)


def _check_block_size(block_size) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def check_block_lists(block_lists: torch.Tensor, block_counts: torch.Tensor, n_blocks: int,
                      n_kv_heads: int | None = None) -> None:
    """The lists of ``n_blocks`` query blocks: shapes and dtypes, then their values (one host sync on CUDA).

    Raises ValueError unless block_lists is [n_blocks, M] (or [n_kv_heads, n_blocks, M]: lists per KV head)
    int32/int64, block_counts [n_blocks] (or [n_kv_heads, n_blocks]) int32/int64 on the same device, every count
    in [1, M], every listed entry in [0, n_blocks), strictly ascending, and every row b lists its diagonal block b.
    `n_kv_heads` None: the head count of 3-D lists is not checked.
    """
    if not isinstance(block_lists, torch.Tensor) or not isinstance(block_counts, torch.Tensor):
        raise ValueError("block_lists and block_counts must be tensors")
    per_head = block_lists.dim() == 3
    heads = block_lists.shape[0] if per_head else None
    if (block_lists.dim() not in (2, 3) or block_lists.shape[-2] != n_blocks or block_lists.dtype not in _INDEX_DTYPES
            or (per_head and n_kv_heads is not None and heads != n_kv_heads)):
        raise ValueError(f"block_lists must be [NB={n_blocks}, M] or [Hkv, NB={n_blocks}, M] (Hkv: the kv heads"
                         f"{'' if n_kv_heads is None else f', {n_kv_heads}'}) int32/int64, got "
                         f"{tuple(block_lists.shape)} {block_lists.dtype}")
    lead = (heads,) if per_head else ()
    if tuple(block_counts.shape) != (*lead, n_blocks) or block_counts.dtype not in _INDEX_DTYPES:
        raise ValueError(f"block_counts must be [{f'Hkv={heads}, ' if per_head else ''}NB={n_blocks}] int32/int64 (a "
                         f"count per row of block_lists), got {tuple(block_counts.shape)} {block_counts.dtype}")
    if block_lists.device != block_counts.device:
        raise ValueError(f"block_lists and block_counts must share one device, got {block_lists.device} and "
                         f"{block_counts.device}")
    if n_blocks == 0:
        return
    m = block_lists.shape[-1]
    lists = block_lists.long().reshape(-1, m)                                   # [heads * NB, M]
    counts = block_counts.long().reshape(-1)
    cols = torch.arange(m, device=lists.device)
    valid = cols[None, :] < counts[:, None]                                    # listed entries
    rows = torch.arange(lists.shape[0], device=lists.device) % n_blocks        # each row's query block
    bad_count = (counts < 1) | (counts > m)
    bad_range = (valid & ((lists < 0) | (lists >= n_blocks))).any(1)
    bad_order = (valid[:, 1:] & (lists[:, 1:] <= lists[:, :-1])).any(1) if m > 1 else torch.zeros_like(bad_count)
    no_diag = ~(valid & (lists == rows[:, None])).any(1)
    flags = torch.stack([bad_count.any(), bad_range.any(), bad_order.any(), no_diag.any()]).tolist()  # one sync

    def where(r: int) -> str:
        return f"{'' if not per_head else f'kv head {r // n_blocks} '}row {r % n_blocks}"

    def row(r: int) -> str:
        return f"{lists[r, :int(counts[r])].tolist()}"

    if flags[0]:
        r = int(bad_count.nonzero()[0, 0])
        at = where(r).replace("row", "query block")
        raise ValueError(f"block_counts must be in [1, M={m}], got {int(counts[r])} for {at}")
    if flags[1]:
        r = int(bad_range.nonzero()[0, 0])
        raise ValueError(f"block_lists {where(r)} lists a key block outside [0, NB={n_blocks}): {row(r)}")
    if flags[2]:
        r = int(bad_order.nonzero()[0, 0])
        raise ValueError(f"block_lists {where(r)} must be strictly ascending in its first block_counts entries, "
                         f"got {row(r)}")
    if flags[3]:
        r = int(no_diag.nonzero()[0, 0])
        raise ValueError(f"block_lists {where(r)} must list its diagonal block {r % n_blocks}, got {row(r)}")


def check_inputs(q, k, v, block_lists, block_counts, block_size) -> None:
    """Shapes, dtypes, devices and list values at the dispatch boundary: a clear error, never a wild read."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a [T, heads, head_dim] tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree (T, head_dim, or q heads not a "
                         f"multiple of kv heads)")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {x.device for x in (q, k, v, block_lists, block_counts) if isinstance(x, torch.Tensor)}
    if len(devices) != 1:
        raise ValueError(f"block_sparse_attention inputs must share one device, got {sorted(map(str, devices))}")
    _check_block_size(block_size)
    check_block_lists(block_lists, block_counts, _n_blocks(t, block_size), k.shape[1])


def dense_block_lists(n_blocks: int, device: torch.device | str | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The lists of full causal attention: query block b lists key blocks 0..b.

    Returns:
        (lists [n_blocks, n_blocks] int32, counts [n_blocks] int32); row b is ``0, 1, .., b`` then padding -1.
    """
    idx = torch.arange(n_blocks, dtype=torch.int32, device=device)
    lists = torch.where(idx[None, :] <= idx[:, None], idx[None, :], torch.full_like(idx, -1)[None, :])
    return lists.contiguous(), idx + 1


def mask_from_block_lists(block_lists: torch.Tensor, block_counts: torch.Tensor, block_size: int, t: int
                          ) -> torch.Tensor:
    """The dense [T, T] bool mask of the lists ([Hkv, T, T] for lists per KV head): ``mask[i, j]`` iff j <= i and
    the key block of j is listed for the query block of i (the lists are checked first, see `check_block_lists`)."""
    _check_block_size(block_size)
    check_block_lists(block_lists, block_counts, _n_blocks(t, block_size))
    return _mask(block_lists, block_counts, block_size, t)


def _mask(block_lists, block_counts, block_size, t):
    """`mask_from_block_lists` on lists already checked ([..., NB, M] lists give [..., T, T])."""
    nb = _n_blocks(t, block_size)
    device = block_lists.device
    m = block_lists.shape[-1]
    valid = torch.arange(m, device=device) < block_counts.long()[..., None]
    cols = torch.where(valid, block_lists.long(), nb)                         # padding -> a dropped column
    listed = torch.zeros((*block_lists.shape[:-1], nb + 1), dtype=torch.bool, device=device)
    listed.scatter_(-1, cols, True)
    blk = torch.arange(t, device=device) // block_size
    pos = torch.arange(t, device=device)
    return listed[..., blk[:, None], blk[None, :]] & (pos[None, :] <= pos[:, None])


def block_sparse_attention_reference(q, k, v, block_lists, block_counts, block_size, scale):
    """Pure torch (also the CPU path): the dense mask of the lists, one masked SDPA call with GQA."""
    check_inputs(q, k, v, block_lists, block_counts, block_size)
    mask = _mask(block_lists, block_counts, block_size, q.shape[0])  # [T, T] or [Hkv, T, T]
    if mask.dim() == 2:
        return token_major_sdpa(q, k, v, scale, attn_mask=mask)
    # lists per KV head: one call per KV head and its q heads, each with its [T, T] mask (a [Hq, T, T] mask takes
    # SDPA's slow path on the CPU: `python benchmarks/sift_plan_check.py --masks`)
    group = q.shape[1] // k.shape[1]
    return torch.cat([token_major_sdpa(q[:, g * group:(g + 1) * group], k[:, g:g + 1], v[:, g:g + 1], scale,
                                       attn_mask=mask[g]) for g in range(k.shape[1])], dim=1)


def block_sparse_attention_triton(q, k, v, block_lists, block_counts, block_size, scale, **overrides):
    """Triton flash attention over the listed key blocks (one program per query block, row chunk and kv head).

    block_size must be a power of two >= 16 here. Overrides (tests, benchmarks): block_m, block_n, num_warps,
    num_stages."""
    check_inputs(q, k, v, block_lists, block_counts, block_size)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the triton block-sparse kernel needs block_size a power of two >= 16, got {block_size}")
    choose_backend(q.device, "triton")
    from ._triton.block_sparse import launch

    return launch(q, k, v, block_lists, block_counts, block_size, scale, **overrides)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_lists: torch.Tensor,
                           block_counts: torch.Tensor, block_size: int, scale: float, *,
                           backend: str | None = None) -> torch.Tensor:
    """Causal attention of a whole prompt restricted to listed key blocks (see the module docstring).

    Args:
        q: [T, Hq, D] queries, RoPE applied. k: [T, Hkv, D] keys, RoPE applied. v: [T, Hkv, D] values.
        block_lists: [NB, M] key blocks of each query block, strictly ascending, padded at the end; or
            [Hkv, NB, M]: lists per KV head.
        block_counts: [NB] (or [Hkv, NB]) listed entries per row (>= 1; the diagonal block must be among them).
        block_size: rows per block (a power of two >= 16 for the triton backend). scale: softmax scale.
        backend: None (the rule in ``dispatch``), ``"triton"`` or ``"torch"``.
    Returns:
        [T, Hq, D] in q's dtype.
    """
    if choose_backend(q.device, backend) == "triton":
        return block_sparse_attention_triton(q, k, v, block_lists, block_counts, block_size, scale)
    return block_sparse_attention_reference(q, k, v, block_lists, block_counts, block_size, scale)
