"""SIFT: a selective index per document instead of its K/V cache, and a block-sparse prefill that reads it.

No K/V is stored. Per document, one prefill of the document alone after the shared prefix measures, at every
layer, how the document's queries spread their attention over its own keys (averaged over heads, summed per block
of `block` tokens). Two bit sets are kept per layer:

- **local** [n_blocks, n_blocks] (lower triangle): for each query block, the fewest key blocks of the document
  that hold `local_mass` of its attention to the document (local attention invariance: what a document attends to
  within itself hardly changes with what surrounds it);
- **cross** [n_blocks]: the fewest key blocks that receive `cross_mass` of all the document's attention to itself
  (cross-attention consistency: keys a document attends to strongly are also what later documents attend to).

At request time every token is computed (positions are exact, nothing is stale), but a document's queries attend
only to: the prefix and the glue rows (titles), their own local window (their block and the one before), their
document's locally marked blocks, and earlier documents' cross-marked blocks. The question and anything without an
index attend densely. The kernel (kernels/block_sparse.py) takes one list of key blocks per query block per layer.

Indexes are keyed like caches (namespace, prefix, document tokens) and held apart from K/V caches, in memory; they
serialise to a few kilobytes (`SiftIndex.to_bytes`: magic, the key, shapes, packed bits, sha256) and
`SiftIndex.from_bytes` refuses (None) any damaged or mismatched one. A document with no index yet attends densely
(`sparse_plan` with None: a full prefill's cost and answer for it) and its index is built when the engine is next
idle (`extra["sift"]["index_deferred"]`); with `on_miss="compute"` it is built before the prefill instead
(`extra["sift"]["index_computed"]`). The indexes a precompute slice or a request builds are measured in one
pass (`compute_indexes`: one GEMM per weight for all the documents, attention per document; on the CPU GEMMs of one
shape, so each index is bit for bit its document's own). An index
can also ride with its document (`Document.sift_index`, the bytes of `FusionEngine.sift_index_bytes`; the LlamaIndex
and LangChain precompute transforms write it into node / Document metadata and the query paths read it back): it is
used only if `from_bytes` accepts it for that request's key, else the document is prefilled densely and counted in
`extra["sift"]["index_rejected"]`.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..kernels.rope import apply_rope

__all__ = ["SiftIndex", "IndexStore", "compute_index", "compute_indexes", "sparse_plan", "MarkedLists", "CrossPick",
           "MAGIC",
           "CROSS_MODES", "HEAD_MODES", "check_modes"]

MAGIC = b"KVFSIFT1"
CROSS_MODES = ("pick", "marks")  # how a document's queries' blocks are chosen (`sparse_plan`'s `cross` and `local`)
HEAD_MODES = ("shared", "kv")  # picked blocks: one list for all heads, or a list per KV head (`sparse_plan`'s `heads`)


@dataclass
class SiftIndex:
    """The selective index of one document.

    Attributes:
        block: tokens per block (document-local blocks, from the document's first token).
        n_tokens: the document's length in tokens.
        local: [n_layers, nb, nb] bool; row q: key blocks query block q attends within the document.
        cross: [n_layers, nb] bool; key blocks later documents attend.
    """

    block: int
    n_tokens: int
    local: Tensor
    cross: Tensor
    _device_copy: tuple = field(default=None, repr=False, compare=False)

    def on(self, device) -> tuple[Tensor, Tensor]:
        """(local, cross) as float tensors on `device`, moved once and kept (a plan reads them per request)."""
        device = torch.device(device)
        if self._device_copy is None or self._device_copy[0] != device:
            self._device_copy = (device, self.local.to(device, torch.float32), self.cross.to(device, torch.float32))
        return self._device_copy[1], self._device_copy[2]

    @property
    def n_blocks(self) -> int:
        return int(self.cross.shape[1])

    def density(self) -> float:
        """Share of the causal (query block, key block) pairs of the document kept by `local`."""
        nb = self.n_blocks
        return float(self.local.sum()) / max(1, self.local.shape[0] * nb * (nb + 1) // 2)

    # -- bytes -------------------------------------------------------------------------------------------------
    def to_bytes(self, key: str) -> bytes:
        """magic | key (64 hex) | n_layers, n_blocks, block, n_tokens (u32) | packed local lower triangle | packed
        cross | sha256 of everything before."""
        n_layers, nb = self.cross.shape
        tri = torch.tril_indices(nb, nb)
        local = self.local[:, tri[0], tri[1]].cpu().numpy().astype(np.uint8)
        body = (MAGIC + key.encode("ascii") + struct.pack("<4I", n_layers, nb, self.block, self.n_tokens)
                + np.packbits(local.reshape(-1)).tobytes() + np.packbits(self.cross.cpu().numpy().reshape(-1)
                                                                         .astype(np.uint8)).tobytes())
        return body + hashlib.sha256(body).digest()

    @classmethod
    def from_bytes(cls, data: bytes, key: str, n_layers: int, n_tokens: int) -> SiftIndex | None:
        """The index in `data` when it is intact and made for exactly this key (model, tokenizer, layout, prefix,
        document tokens), `n_layers` and `n_tokens`; None otherwise (the caller prefills that document densely)."""
        try:
            if not isinstance(data, (bytes, bytearray)) or len(data) < len(MAGIC) + 64 + 16 + 32:
                return None
            body, digest = bytes(data[:-32]), bytes(data[-32:])
            if hashlib.sha256(body).digest() != digest or not body.startswith(MAGIC):
                return None
            at = len(MAGIC)
            if body[at:at + 64] != key.encode("ascii"):
                return None
            layers, nb, block, tokens = struct.unpack("<4I", body[at + 64:at + 80])
            if layers != n_layers or tokens != n_tokens or block < 1 or nb != -(-tokens // block):
                return None
            n_tri = nb * (nb + 1) // 2
            bits = np.unpackbits(np.frombuffer(body[at + 80:], dtype=np.uint8))
            need_local = layers * n_tri
            if bits.size < need_local + layers * nb or len(body[at + 80:]) != (
                    -(-need_local // 8) + -(-(layers * nb) // 8)):
                return None
            local_bits = bits[:need_local].reshape(layers, n_tri)
            cross_start = -(-need_local // 8) * 8
            cross = torch.from_numpy(bits[cross_start:cross_start + layers * nb].reshape(layers, nb).astype(bool))
            local = torch.zeros(layers, nb, nb, dtype=torch.bool)
            tri = torch.tril_indices(nb, nb)
            local[:, tri[0], tri[1]] = torch.from_numpy(local_bits.astype(bool))
            return cls(block, tokens, local, cross)
        except (ValueError, struct.error, IndexError):
            return None


def _fewest_covering(mass: Tensor, share: float) -> Tensor:
    """Bool mask of the fewest entries of each row of `mass` (>= 0) whose sum reaches `share` of the row's sum."""
    order = torch.argsort(mass, dim=-1, descending=True)
    sorted_mass = torch.gather(mass, -1, order)
    total = sorted_mass.sum(-1, keepdim=True).clamp_min(1e-30)
    before = (sorted_mass.cumsum(-1) - sorted_mass) / total  # mass strictly before each entry
    keep_sorted = before < share
    out = torch.zeros_like(keep_sorted)
    return out.scatter(-1, order, keep_sorted)


@torch.inference_mode()
def compute_index(engine, doc_ids: list[int], block: int = 16, local_mass: float = 0.8,
                  cross_mass: float = 0.5, rows_per_chunk: int = 512) -> SiftIndex:
    """Prefills the document alone after the engine's prefix and measures its attention (see the module doc)."""
    return compute_indexes(engine, [doc_ids], block, local_mass, cross_mass, rows_per_chunk)[0]


@torch.inference_mode()
def compute_indexes(engine, docs: list[list[int]], block: int = 16, local_mass: float = 0.8,
                    cross_mass: float = 0.5, rows_per_chunk: int = 512, max_tokens: int | None = None,
                    chunk: int | None = None) -> list[SiftIndex]:
    """Each document's index, as `compute_index` measures it (the document alone after the prefix), with the
    documents packed into passes of at most `max_tokens` rows (engine/docpass.py: one GEMM per weight for all of
    them; GEMMs of `chunk` rows when set, so an index does not depend on its pass-mates; the attention, explicit
    here to read its weights, per document). None: the engine's documents-pass settings (`document_pass_tokens`,
    `document_chunk_rows`; `DocumentCache.pass_settings`)."""
    from .docpass import pack

    if any(len(d) == 0 for d in docs):
        raise ValueError("every document needs at least one token")
    if max_tokens is None or chunk is None:
        tokens, rows = engine.doc_cache.pass_settings()
        max_tokens = tokens if max_tokens is None else max_tokens
        chunk = rows if chunk is None else chunk
    out: list[SiftIndex | None] = [None] * len(docs)
    order = sorted(range(len(docs)), key=lambda i: len(docs[i]))
    for group in pack([len(docs[i]) for i in order], max(1, max_tokens)):
        members = [order[g] for g in group]
        for i, idx in zip(members, _index_pass(engine, [docs[i] for i in members], block, local_mass, cross_mass,
                                               rows_per_chunk, chunk or None), strict=True):
            out[i] = idx
    return out


def _index_pass(engine, docs: list[list[int]], block: int, local_mass: float, cross_mass: float,
                rows_per_chunk: int, chunk: int | None) -> list[SiftIndex]:
    """One documents pass (engine/docpass.py `layer_pass`) whose attention is explicit, per document, so its weights
    can be read: each layer's local and cross marks of every document."""
    from .docpass import layer_pass

    dec = engine.decoder
    spec, dev = dec.spec, dec.device
    prefix = engine.doc_cache.prefix_kv()
    p = int(prefix.k.shape[1])
    lens = [len(d) for d in docs]
    cos, sin = engine.runner.rope(p + max(lens))
    group = spec.n_heads // spec.n_kv_heads
    spans = [(sum(lens[:j]), n) for j, n in enumerate(lens)]
    # per document: its block count, lower triangle, tokens' blocks; per layer its bit sets (on the device: one
    # copy to the host at the end, no sync per layer)
    geo = []
    for _, n in spans:
        nb = -(-n // block)
        geo.append((nb, torch.tril(torch.ones(nb, nb, dtype=torch.bool, device=dev)),
                    torch.arange(n, device=dev) // block))
    local: list[list[Tensor]] = [[] for _ in docs]
    cross: list[list[Tensor]] = [[] for _ in docs]
    pos = torch.arange(p + max(lens), device=dev)

    def attend(i, q, k, v):
        # the prefix (it may live in host memory: the host tier) rotated and widened once per layer
        pk = apply_rope(prefix.k[i].to(k.device, k.dtype), cos[:p], sin[:p]).float().repeat_interleave(group, dim=1)
        pv = prefix.v[i].to(v.device, v.dtype).float().repeat_interleave(group, dim=1)
        outs = []
        for j, (a, n) in enumerate(spans):
            nb, tril, blk = geo[j]
            qr = apply_rope(q[a:a + n], cos[p:p + n], sin[p:p + n]).float()
            kr = torch.cat([pk, apply_rope(k[a:a + n], cos[p:p + n], sin[p:p + n]).float()
                            .repeat_interleave(group, dim=1)])
            vf = torch.cat([pv, v[a:a + n].float().repeat_interleave(group, dim=1)])
            mass = torch.zeros(nb, nb, device=dev)  # [query block, key block] of attention within the doc
            for c in range(0, n, rows_per_chunk):
                e = min(n, c + rows_per_chunk)
                sc = torch.einsum("thd,khd->htk", qr[c:e], kr) * spec.scale
                sc = sc.masked_fill(pos[None, None, :p + n] > (p + torch.arange(c, e, device=dev))[None, :, None],
                                    float("-inf"))
                pr = torch.softmax(sc, dim=-1)
                outs.append(torch.einsum("htk,khd->thd", pr, vf).to(q.dtype))
                doc = pr[:, :, p:].mean(0)  # [rows, n] over heads
                per_key_block = torch.zeros(e - c, nb, device=dev).index_add_(1, blk, doc)
                mass.index_add_(0, blk[c:e], per_key_block)
            mass = torch.tril(mass)
            local[j].append(_fewest_covering(mass, local_mass) & tril)
            cross[j].append(_fewest_covering(mass.sum(0)[None], cross_mass)[0])
        return torch.cat(outs)

    layer_pass(dec, docs, chunk, attend, keep=False)
    return [SiftIndex(block, n, torch.stack(local[j]).cpu(), torch.stack(cross[j]).cpu())
            for j, (_, n) in enumerate(spans)]


def _span_map(start: int, n_tokens: int, block_loc: int, block_abs: int) -> tuple[int, Tensor]:
    """(first kernel block b0, [nb_local, w] float): which of the kernel blocks b0 .. b0 + w - 1 each
    document-local block's tokens fall in (a document covers a contiguous run of kernel blocks)."""
    nb = -(-n_tokens // block_loc)
    lo = start + torch.arange(nb) * block_loc
    hi = torch.clamp(lo + block_loc, max=start + n_tokens) - 1
    first, last = lo // block_abs, hi // block_abs
    b0 = int(first[0])
    cols = torch.arange(b0, int(last[-1]) + 1)
    return b0, ((cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None])).float()


def _masks(n: int, n_layers: int, docs: list[tuple[int, int, SiftIndex | None]], block: int, device,
           window: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The block masks of a prompt, by part (all causal):
    - base [NB, NB]: what every plan keeps: the local window, the prefix (seen by all; its rows dense), the rows from
      the tail on (dense), and the rows of documents with no usable index (dense);
    - local [L, NB, NB]: each document's own marked blocks (local marks), mapped to kernel blocks;
    - cross [L, NB, NB]: each document's cross-marked blocks, opened to the queries from its last block on;
    - own [NB, NB]: each indexed document's own square (the blocks a local pick may open);
    - earlier [NB, NB]: an earlier document's blocks, for the queries from that document's last block on (the blocks
      a cross pick may open)."""
    nb = -(-n // block)
    tril = torch.tril(torch.ones(nb, nb, dtype=torch.bool, device=device))
    first = min((s for s, _, _ in docs), default=n)
    last = max((e for _, e, _ in docs), default=n)
    # the local window: a block and the `reach` blocks before it (at least the one before)
    reach = max(1, -(-int(window) // block))
    back = torch.arange(nb, device=device)
    back = back[:, None] - back[None, :]  # query block - key block
    base = (back >= 0) & (back <= reach)
    if first > 0:  # the prefix (system prompt, attention sink): seen by every query; its own rows attend densely
        base[:, :(first - 1) // block + 1] = True
        base[:(first - 1) // block + 1] = True
    if last < n:  # blocks with a tail row attend to everything before
        base[last // block:] = True
    local_m = torch.zeros(n_layers, nb, nb, dtype=torch.bool, device=device)
    cross_m = torch.zeros_like(local_m)
    own = torch.zeros(nb, nb, dtype=torch.bool, device=device)
    earlier = torch.zeros_like(own)
    for s, e, idx in docs:
        qb0, qb1 = s // block, (e - 1) // block + 1
        if idx is None:  # no usable index: this document's rows attend densely
            base[qb0:qb1] = True
            continue
        local, cross = idx.on(device)  # [L, nbl, nbl], [L, nbl] float
        b0, pm = _span_map(s, e - s, idx.block, block)
        pm = pm.to(device)
        w = pm.shape[1]
        local_m[:, b0:b0 + w, b0:b0 + w] |= (pm.T @ local @ pm) > 0  # its own marked blocks, mapped to kernel blocks
        own[b0:b0 + w, b0:b0 + w] = True
        keys = (cross @ pm) > 0  # [L, w]
        # queries from the document's last block on (the later documents) see its cross-marked blocks
        cross_m[:, (e - 1) // block:, b0:b0 + w] |= keys[:, None, :]
        earlier[(e - 1) // block:, b0:b0 + w] = True
    return base & tril, local_m & tril, cross_m & tril, own & tril, earlier & tril


def _compact(m: Tensor, width: int) -> Tensor:
    """[..., NB, width] int32: each row's listed blocks compacted to the front, ascending (a cumulative count, no
    sort); unlisted ones go to a spare last column, dropped; the padding after a row's count is 0 (never read)."""
    nb = m.shape[-1]
    slot = torch.where(m, m.cumsum(-1, dtype=torch.int32) - 1, width).long()
    cols = torch.arange(nb, dtype=torch.int32, device=m.device).expand_as(slot)
    out = torch.zeros(*m.shape[:-1], width + 1, dtype=torch.int32, device=m.device).scatter_(-1, slot, cols)
    return out[..., :width].contiguous()


def check_modes(cross: str, local: str, heads: str) -> None:
    """How a plan picks its blocks (`sparse_plan`'s and `Sift`'s cross / local / heads): a ValueError if invalid."""
    for name, mode in (("cross", cross), ("local", local)):
        if mode not in CROSS_MODES:
            raise ValueError(f"{name} must be one of {CROSS_MODES}, got {mode!r}")
    if heads not in HEAD_MODES:
        raise ValueError(f"heads must be one of {HEAD_MODES}, got {heads!r}")
    if heads == "kv" and cross == "marks" and local == "marks":
        raise ValueError('heads="kv" picks blocks per KV head: it needs cross="pick" or local="pick"')


def sparse_plan(n: int, n_layers: int, docs: list[tuple[int, int, SiftIndex | None]], block: int,
                device, window: int = 0, cross: str = "marks", local: str = "marks", heads: str = "shared",
                max_density: float = 1.0):
    """Per layer (key-block lists [NB, M] int32, counts [NB] int32) for a prompt of `n` tokens; and the density
    (share of the causal block pairs attended, averaged over layers). A plan denser than `max_density` (one the
    request will not use: the sparse kernel would be slower than dense attention) is not built: (None, None,
    density), decided right after the block masks are counted.

    Every layer is built at once on `device` ([n_layers, NB, NB] block masks; each document touches only the
    square of kernel blocks it covers and the columns of its cross marks), with one host read at the end (the
    lists' width and the density).

    Args:
        docs: (start, end, index or None) of each document in prompt order. The prefix (rows before the first
            document) is seen by every query and the tail (rows after the last) sees everything; glue rows between
            documents (titles) get the local window only.
        block: the kernel's block size.
        window: a dense local window, in tokens: every query block also sees the key blocks that hold the `window`
            tokens before its first row (0: its own block and the one before only).
        cross: "marks" (the indexes' cross marks); "pick": each query block opens as many earlier-document blocks
            as the cross marks would, chosen per layer from the request's own queries and keys (`CrossPick`): the
            lists are then a `CrossPick` (`.layer(i, q, k)` gives the layer's lists and counts) and the counts
            the marks' per-layer counts (the same density).
        local: "marks" (the indexes' local marks); "pick": a document's own blocks beyond the window are chosen per
            request too, in one pool with the picked cross blocks when `cross` is "pick" (each query block opens as
            many blocks in all as the marks would).
        heads: "shared": the picked blocks are one list for all heads (estimates averaged over KV heads); "kv": each
            KV head picks its own, as many as the shared list holds (the lists are then [KV, NB, M]; same
            density). Needs `cross` or `local` "pick".
    """
    check_modes(cross, local, heads)
    device = torch.device(device)
    nb = -(-n // block)
    base, local_m, cross_m, own, earlier = _masks(n, n_layers, docs, block, device, window)
    full = base | local_m | cross_m
    cnt = full.sum(2, dtype=torch.int32)  # [L, NB]
    width, kept = torch.stack([cnt.max().long(), cnt.sum(dtype=torch.long)]).tolist()  # the one host read
    density = kept / float(n_layers * nb * (nb + 1) // 2)
    if density > max_density:
        return None, None, density
    if cross == "marks" and local == "marks":
        counts = list(cnt.unbind(0))
        return MarkedLists(_compact(full, width).unbind(0), counts), counts, density
    static, reachable = base.expand_as(full), torch.zeros_like(own)
    for mode, marks, pool in ((local, local_m, own), (cross, cross_m, earlier)):
        if mode == "marks":
            static = static | marks
        else:
            reachable = reachable | pool
    return (CrossPick(static, (full & ~static).sum(2), reachable, n, block, width, per_head=heads == "kv"),
            list(cnt.unbind(0)), density)


class MarkedLists(list):
    """The per-layer key-block lists of a plan fixed by the marks alone (a list of [NB, M] int32, one per layer), with
    `CrossPick`'s interface: `.layer(i, q, k)` gives layer i's (lists, counts) and ignores q and k."""

    def __init__(self, lists, counts: list[Tensor]) -> None:
        super().__init__(lists)
        self.counts = counts

    def layer(self, i: int, q: Tensor | None = None, k: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self[i], self.counts[i]


class CrossPick:
    """sift's cross blocks chosen per request instead of by the indexes' cross marks.

    Measured on the embedded model (benchmarks/sift_mass.py): a later document's rows put about a fifth of their
    attention on earlier documents, and which blocks they look at depends on the rows, so one fixed set of blocks
    per document (the cross marks, or even the best such set) leaves most of what the marks drop. Here each query
    block keeps its local marks, window and prefix, and opens the earlier-document blocks of highest estimated
    attention, as many as the cross marks would have opened: block-mean queries (averaged over each KV head's
    group) against block-mean keys, a softmax per head over the causal blocks, averaged over heads. One small
    [kv heads, NB, NB] product and an NB x NB sort per layer, no host read.

    `per_head`: no average over KV heads; each KV head opens its own blocks (as many as the shared list would), and
    `layer` gives lists [KV, NB, width] and counts [KV, NB] (the kernel's lists per KV head). Measured on the
    embedded model (benchmarks/sift_mass.py, docs/quality/sift_coinrag.md): one shared list leaves some heads far
    more mass than others, but lists picked per KV head from this estimate drop as much mass in all and raise KL
    to full prefill ~3x, so the shared list is the default.
    """

    def __init__(self, static: Tensor, counts: Tensor, reachable: Tensor, n: int, block: int, width: int,
                 per_head: bool = False) -> None:
        self.static, self.counts, self.reachable = static, counts, reachable
        self.block, self.width, self.per_head = block, width, per_head
        nb = static.shape[-1]
        dev = static.device
        rows = torch.bincount(torch.arange(n, device=dev) // block, minlength=nb)
        self.size = rows.clamp_min(1).float()[:, None, None]  # rows per block (the last may be short)
        self.tril = torch.tril(torch.ones(nb, nb, dtype=torch.bool, device=dev))

    def layer(self, i: int, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """(lists [NB, width] int32, counts [NB] int32) of layer i, from its rotated q [T, H, D] and k [T, KV, D]
        ([KV, NB, width] and [KV, NB] with `per_head`)."""
        nb = self.static.shape[-1]
        kvh, d = k.shape[1], k.shape[2]
        pad = nb * self.block - q.shape[0]

        def block_mean(x: Tensor) -> Tensor:  # [T, KV, D] -> [NB, KV, D] float32, one pass over x
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
            return x.view(nb, self.block, kvh, d).sum(1, dtype=torch.float32) / self.size

        group = q.shape[1] // kvh
        bq = block_mean(q.unflatten(1, (kvh, group)).sum(2, dtype=torch.float32) / group)  # each KV head's group
        est = torch.einsum("qhd,khd->hqk", bq, block_mean(k)) * (d ** -0.5)
        est = torch.softmax(est.masked_fill(~self.tril, float("-inf")), -1)  # [KV, NB, NB]
        if not self.per_head:
            est = est.mean(0, keepdim=True)
        open_ = self.reachable & ~self.static[i]
        est = est.masked_fill(~open_, -1.0)
        order = torch.argsort(est, dim=-1, descending=True)
        take = (torch.arange(nb, device=q.device)[None, :] < self.counts[i][:, None]).expand_as(order)
        pick = torch.zeros(order.shape, dtype=torch.bool, device=q.device).scatter_(-1, order, take) & open_
        m = self.static[i] | pick  # [KV or 1, NB, NB]
        if not self.per_head:
            m = m[0]
        return _compact(m, self.width), m.sum(-1, dtype=torch.int32)


class IndexStore:
    """Selective indexes in memory, least recently used dropped past `budget_bytes` (serialised size)."""

    def __init__(self, budget_bytes: int = 64 << 20, max_carried: int = 1024) -> None:
        self.budget = int(budget_bytes)
        self.max_carried = int(max_carried)
        self._carried: OrderedDict[tuple, SiftIndex | None] = OrderedDict()  # carried bytes' verdicts (see carried)
        self._items: OrderedDict[str, tuple[SiftIndex, int]] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def get(self, key: str) -> SiftIndex | None:
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item[0]

    def put(self, key: str, index: SiftIndex) -> None:
        size = len(index.to_bytes(key))
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._items[key] = (index, size)
        self.bytes += size
        while self.bytes > self.budget and len(self._items) > 1:
            _, (_, s) = self._items.popitem(last=False)
            self.bytes -= s

    def carried(self, key: str, data: bytes, n_layers: int, n_tokens: int) -> SiftIndex | None:
        """The index a document carries (`SiftIndex.from_bytes` for this request's key), or None when it is refused.
        The verdict is memoised per (key, bytes), so a document that keeps coming back with the same bytes is parsed,
        checked and moved to the device once, not per request."""
        memo_key = (key, data, n_layers, n_tokens)
        if memo_key in self._carried:
            self._carried.move_to_end(memo_key)
            return self._carried[memo_key]
        idx = SiftIndex.from_bytes(data, key, n_layers, n_tokens)
        self._carried[memo_key] = idx
        while len(self._carried) > self.max_carried:
            self._carried.popitem(last=False)
        return idx

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
