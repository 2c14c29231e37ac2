"""Many documents' caches in one pass: each document after the shared prefix, as if computed alone.

A document's cache is its rows' pre-RoPE K/V when it is prefilled alone after the prompt prefix (positions P ..
P + L - 1, attending to the prefix and to itself). Computing the documents of a request, or of a precompute slice,
one prefill each reads every weight once per document and, on a GPU, launches every layer's kernels once per
document: for a hotpotqa example's ten passages on the embedded model that cost 1.1-1.7x one full prefill of the
whole prompt on the CPU, one pass 0.8-1.3x (`benchmarks/cold_documents.py --real`).

Here the documents' rows are packed into one row set and run through each layer together: the projections and the
MLP are one GEMM over all of them; the attention is per document (on CUDA one batched call, a batch row per
document padded to the longest; elsewhere one call each), its queries against the prefix's keys and its own,
causal by position (``key position <= query position``), so no document sees another. Documents are sorted by length (less padding) and packed into passes of
at most `max_tokens` rows (a longer document is a pass of its own).

What it gives equals the one-document prefill's cache up to the rounding of GEMMs over a different row count
(tests/engine/test_docpass.py holds it to the per-document path's tolerance, and recompute-all to full prefill).
With `chunk` every GEMM runs at one shape, and a document's cache is then the same bits whatever shares its pass.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..kernels.causal import head_major_sdpa, token_major_sdpa
from ..kernels.rope import apply_rope
from .store.entry import DocKV

__all__ = ["documents_pass", "pack", "layer_pass"]


def pack(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of `lengths` grouped into consecutive passes of at most `max_tokens` rows (a longer one alone)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    passes, cur, rows = [], [], 0
    for i, n in enumerate(lengths):
        if cur and rows + n > max_tokens:
            passes.append(cur)
            cur, rows = [], 0
        cur.append(i)
        rows += n
    if cur:
        passes.append(cur)
    return passes


def documents_pass(dec, rope, prefix: DocKV, docs: Sequence[Sequence[int]], max_tokens: int = 8192, *,
                   batched: bool | None = None, chunk: int | None = None) -> list[DocKV]:
    """Each document's cache, computed after `prefix` as if alone, packed into as few passes as fit. Runs under the
    caller's autograd mode (the engine's in inference mode; adapter training differentiates through it).

    Args:
        dec: the decoder that computes the documents (the engine's document runner's: with an offline fusion
            adapter, the adapted model).
        rope: n -> (cos, sin) tables covering positions [0, n) (`Runner.rope`).
        prefix: the prefix's cache: [n_layers, P, n_kv_heads, head_dim] pre-RoPE K and V, positions 0 .. P - 1.
        docs: token ids of each document (each non-empty).
        max_tokens: rows per pass.
        batched: the attention of a pass as one padded call (True) or one call per document at its own length
            (False); None: padded on CUDA, where one call per document per layer costs more in launches than the
            padding costs, per document elsewhere (the CPU pays for the padding's work).
        chunk: rows of every projection and MLP call: the pass's rows are padded to a multiple of it and run through
            each weight `chunk` rows at a time, so every GEMM has the same shape whatever the pass holds. A GEMM of
            one shape computes a row the same wherever it sits and whatever its neighbours are (measured on the
            CPU's bf16 and fp32 GEMMs; another row count can round differently), so with a chunk and per-document
            attention a document's cache does not depend, bit for bit, on which documents share its pass or
            where it sits in it. None: one call over the whole pass (fastest; a cache then moves with its
            pass-mates by an ulp).
    Returns:
        one DocKV per document, in order: [n_layers, L, n_kv_heads, head_dim] pre-RoPE K and V.
    """
    if any(len(d) == 0 for d in docs):
        raise ValueError("every document needs at least one token")
    if not docs:
        return []
    dev, p = dec.device, int(prefix.k.shape[1])
    cos, sin = rope(p + max(len(d) for d in docs))
    # the prefix's keys rotated once for every pass: [n_layers] of [P, Hkv, D]
    prefix_k = [apply_rope(prefix.k[i].to(dev), cos[:p], sin[:p]) for i in range(dec.spec.n_layers)]
    prefix_v = [prefix.v[i].to(dev) for i in range(dec.spec.n_layers)]
    padded = batched if batched is not None else dev.type == "cuda"
    out: list[DocKV | None] = [None] * len(docs)
    order = sorted(range(len(docs)), key=lambda i: len(docs[i]))  # passes of like lengths: little padding
    for group in pack([len(docs[i]) for i in order], max_tokens):
        members = [order[g] for g in group]
        kvs = _one_pass(dec, (cos, sin), prefix_k, prefix_v, [docs[i] for i in members], padded, chunk)
        for i, kv in zip(members, kvs, strict=True):
            out[i] = kv
    return out


def layer_pass(dec, docs: Sequence[Sequence[int]], chunk: int | None, attend, keep: bool = True
               ) -> tuple[list[Tensor], list[Tensor]]:
    """The skeleton every documents pass shares: the documents' rows packed one after another, run through every
    layer, projections and MLP over all of them at once (`chunk` rows per GEMM when set, the rows padded to a
    multiple of it), attention by the caller: `attend(i, q, k, v)` gets layer i's pre-RoPE q/k/v of the real rows
    ([T, H, D], documents in order) and returns their attention output [T, Hq, D].

    Returns:
        (per-layer K, per-layer V) of the real rows, pre-RoPE (empty lists when `keep` is False).
    """
    n_rows = sum(len(d) for d in docs)
    pad = 0 if chunk is None else -n_rows % chunk  # rows computed and dropped, so every chunk is full
    ids = torch.tensor([t for d in docs for t in d] + [0] * pad, dtype=torch.long, device=dec.device)
    h = dec.embed_tokens(ids)
    ks, vs = [], []
    for i in range(dec.spec.n_layers):
        q, k, v = (t[:n_rows] for t in _by_chunk(lambda x: dec.project(i, x), chunk, h))  # [T, H, D] pre-RoPE
        if keep:
            ks.append(k)
            vs.append(v)
        o = attend(i, q, k, v)
        if pad:
            o = torch.cat([o, o.new_zeros(pad, *o.shape[1:])])
        h = _by_chunk(lambda x, a: dec.finish(i, x, a), chunk, h, o)
    return ks, vs


def _one_pass(dec, tables, prefix_k: list[Tensor], prefix_v: list[Tensor], docs: list[Sequence[int]],
              padded: bool, chunk: int | None = None) -> list[DocKV]:
    spec, dev = dec.spec, dec.device
    cos, sin = tables
    p, b = int(prefix_k[0].shape[0]), len(docs)
    lens = torch.tensor([len(d) for d in docs])
    width = int(lens.max())
    n_rows = int(lens.sum())
    starts = torch.cumsum(lens, 0) - lens
    within = torch.arange(n_rows) - starts.repeat_interleave(lens)            # [T] row's index in its document
    rope_rows = (cos[p + within.to(dev)], sin[p + within.to(dev)])            # each document after the prefix
    spans = list(zip(starts.tolist(), lens.tolist()))
    # key <= query by position: a row sees the prefix and its document's rows up to itself
    if not padded:
        key = torch.arange(p + width, device=dev)
        mask = key[None, :] <= (p + torch.arange(width, device=dev))[:, None]  # [W, P + W]
    else:  # a batch row per document, padded to the longest: pad keys sit after every real row of their
        # document, so no real row sees one; pad rows are computed and dropped. The rule is causal attention aligned
        # to the last key (lower right), which the fused CUDA kernels take as such (torch's CausalBias)
        j = torch.arange(width)
        real = j[None, :] < lens[:, None]                                      # [B, W] a document's rows, then pad
        flat = torch.where(real, starts[:, None] + j[None, :], 0).to(dev)      # [B, W] its flat row (pad: row 0)
        real = real.to(dev)
        bottom_right = _lower_right(width, p + width)

    def attend(i, q, k, v):
        qr, kr = apply_rope(q, *rope_rows), apply_rope(k, *rope_rows)
        pk, pv = prefix_k[i], prefix_v[i]
        if padded:
            def heads(x):
                return x[flat].transpose(1, 2)                                 # [B, H, W, D]
            keys = torch.cat([pk.transpose(0, 1)[None].expand(b, -1, -1, -1), heads(kr)], dim=2)
            vals = torch.cat([pv.transpose(0, 1)[None].expand(b, -1, -1, -1), heads(v)], dim=2)
            o = head_major_sdpa(heads(qr), keys, vals, spec.scale, attn_mask=bottom_right)  # [B, Hq, W, D]
            return o.transpose(1, 2)[real]                                     # [T, Hq, D], flat row order
        # one call per document, at its own length
        return torch.cat([token_major_sdpa(qr[a:a + n], torch.cat([pk, kr[a:a + n]]), torch.cat([pv, v[a:a + n]]),
                                           spec.scale, attn_mask=mask[:n, :p + n]) for a, n in spans])

    ks, vs = layer_pass(dec, docs, chunk, attend)
    k_all, v_all = torch.stack(ks), torch.stack(vs)                            # [n_layers, T, Hkv, D]
    return [DocKV(k_all[:, a:a + n].clone(), v_all[:, a:a + n].clone()) for a, n in spans]


def _by_chunk(fn, chunk: int | None, *xs: Tensor):
    """fn over the rows of `xs` (each a multiple of `chunk` rows), `chunk` rows per call, outputs concatenated;
    one call when `chunk` is None."""
    if chunk is None or xs[0].shape[0] == chunk:
        return fn(*xs)
    outs = [fn(*(x[a:a + chunk] for x in xs)) for a in range(0, xs[0].shape[0], chunk)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
    return torch.cat(outs)


def _lower_right(n_queries: int, n_keys: int):
    """torch's lower-right causal bias. Imported here, not at module import: torch.nn.attention.bias imports triton,
    and importing triton before TRITON_INTERPRET is set (the kernel tests set it on CPU-only machines) fixes its
    built-in functions as compiled ones for the whole process."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(n_queries, n_keys)
