"""The document-cache service: every document's K/V cache, computed once after the prompt prefix, then served.

A `DocumentCache` owns the `DocStore` (memory tier, optional disk tier, optional shared Redis tier) and the
per-document work around it:

- `compute(ids, context)`: the one "prefill after the prefix and keep the document's rows" helper; stores
  nothing. `after_prefix(pieces)` lays out such a prompt for other passes over it (e.g. the anchor profiler).
- `kvs(docs, strategy)`: the caches a request reads, looked up by content key and computed on a miss (a changed
  text under a known id is `stale` and recomputed); a strategy's `cache_variant` and `needs_extras` are served
  here by `cache_variants` and `doc_profilers`.
- `register(doc)` / `forget(ids)`: the registry of bodies that chat prompts are searched for (persisted with the
  disk tier), and eviction by id.

Shapes: a DocKV's `k` and `v` are [n_layers, tokens, n_kv_heads, head_dim], pre-RoPE, at local positions (a
document's first row sits right after the P prefix tokens). Not thread-safe: the engine calls it under its lock.

Hooks (their first argument is this DocumentCache, or an engine owning one; either carries `prompts`, `runner`,
`decoder`, `namespace`, `config`, `context_window`, `store`, `corpus`):
- `doc_profilers[name](cache, ids, kv) -> {name: Tensor}`: extras stored with a document's entry.
- `cache_variants[name](cache, strategy, doc, ids) -> (DocKV, document tokens computed)`: a replacement cache.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from .config import EngineConfig
from .corpus import DocumentPool, default_cache_variants
from .fusion.base import Strategy
from .fusion.reuse import Reuse
from .profile import default_doc_profilers
from .prompt import PromptBuilder
from .registry import DocumentIndex
from .runner import Runner, Segment
from .store import CorruptEntry, DocKV, DocStore, Namespace, content_key
from .store.pool import KVPool, share_rows
from .decode import decode_rows, request_rows, sized_rows
from .docpass import documents_pass
from .types import Document

#: rows of every GEMM of a CPU documents pass (engine/docpass.py `chunk`): one shape, so a cache does not depend on
#: its pass-mates; small chunks leave the CPU's bf16 GEMMs' fast path (`python benchmarks/gemm_chunk_rows.py` times
#: 64-512-row chunks against one GEMM and checks that a row's result does not depend on its place or neighbours)
DOCUMENT_CHUNK_ROWS = 256

__all__ = ["DocumentCache", "Piece"]

#: A run of prompt tokens after the prefix: (token ids, their cached K/V, or None to compute them).
Piece = tuple[Sequence[int], DocKV | None]


class DocumentCache:
    """Per-document K/V caches of one model and prompt prefix.

    Args:
        runner: the Runner over the model; its decoder (`runner.dec`) gives the shapes, device and dtype.
        doc_runner: the Runner documents are computed by (the model with its fusion adapter, engine/adapter.py);
            default: `runner`. The prefix is always computed by `runner`.
        prompts: the PromptBuilder (the prefix every cache is computed after; document tokenization).
        namespace: the cache namespace (model, tokenizer and dtype fingerprints).
        config: EngineConfig (memory and disk budgets, `kv_tier`, `scratch_tokens`, `id_index_bytes`, ...).
        context_window: the model's context window in tokens (sizes the pool's scratch rows; caps variants).

    Attributes:
        store: the DocStore (memory tier, disk tier when `config.disk_cache_dir` is set).
        registry: DocumentIndex of the bodies seen (precomputed, registered, used), restored from the disk tier.
        doc_profilers: extras name -> hook (see the module doc); default: qcfuse's "anchors".
        cache_variants: variant name -> hook (see the module doc); default: "fusionrag".
        corpus: the Corpus neighbour-based variants search (None until set).
        pool: the DocumentPool of documents seen (requests and precompute), what `pick="pool"` draws context from.
        prefix_key: content key of the prompt prefix (also scopes the store's id rows).
    """

    def __init__(self, runner: Runner, prompts: PromptBuilder, namespace: Namespace, config: EngineConfig, *,
                 context_window: int, doc_runner: Runner | None = None) -> None:
        self.runner = runner
        self.doc_runner = doc_runner or runner  # computes documents (with the fusion adapter, when one is set)
        self.decoder = runner.dec
        self.prompts = prompts
        self.namespace = namespace
        self.config = config
        self.context_window = int(context_window)
        self.device, self.dtype = self.decoder.device, self.decoder.dtype
        self.prefix_key = content_key(namespace, [], prompts.prefix_ids)
        self.store = self._make_store()
        self.registry = DocumentIndex(config.id_index_bytes)
        if self.store.disk is not None:  # registrations persist with the disk cache: stock paths fuse after a restart
            for reg in self.store.disk.registrations():
                self.registry.add_fingerprint(*reg)
        self.doc_profilers = default_doc_profilers()
        self.cache_variants = default_cache_variants()
        self.corpus = None
        self.pool = DocumentPool()

    # -- computing ---------------------------------------------------------------------------------------------
    def prefix_kv(self) -> DocKV:
        """The prompt prefix's K/V ([n_layers, P, n_kv_heads, head_dim]): computed once, kept in memory."""
        kv = self.store.memory.get(self.prefix_key)
        if kv is None:
            ids = torch.tensor(self.prompts.prefix_ids, dtype=torch.long)  # [P]
            p = int(ids.numel())
            kv = self.runner.prefill(ids, [Segment(0, p, None)], Reuse(), 0.0, capture=(0, p),
                                     want_logits=False).captured
            kv = self.store.put(None, self.prefix_key, kv)
        self.store.touch(self.prefix_key)
        return kv

    def after_prefix(self, pieces: Iterable[Piece]) -> tuple[Tensor, list[Segment]]:
        """A prompt of the prefix followed by `pieces`, laid out for `Runner.prefill`.

        Args:
            pieces: (token ids, DocKV or None) in order: served from that K/V (selectable rows) or computed.
        Returns:
            ([N] token ids, segments covering [0, N) in order: the cached prefix (never selectable), one per piece).
        """
        ids = [int(t) for t in self.prompts.prefix_ids]
        segs = [Segment(0, len(ids), self.prefix_kv(), selectable=False)]
        for piece, kv in pieces:
            segs.append(Segment(len(ids), len(ids) + len(piece), kv))
            ids.extend(int(t) for t in piece)
        return torch.tensor(ids, dtype=torch.long), segs

    def compute(self, ids: Sequence[int], context: Iterable[Piece] = ()) -> DocKV:
        """Prefills `ids` after the prefix (and `context`, pieces as in `after_prefix`); stores nothing.

        Returns:
            the pre-RoPE K/V of the rows of `ids`: [n_layers, len(ids), n_kv_heads, head_dim].
        """
        context = list(context)
        if not context:
            return self.compute_many([ids])[0]
        full, segs = self.after_prefix([*context, (ids, None)])
        n = int(full.numel())
        return self.doc_runner.prefill(full, segs, Reuse(), 0.0, capture=(n - len(ids), n),
                                       want_logits=False).captured

    def compute_many(self, docs: Sequence[Sequence[int]]) -> list[DocKV]:
        """Each of `docs` prefilled alone after the prefix, all in as few passes as fit (engine/docpass.py); stores
        nothing. Returns: one pre-RoPE DocKV per document, in order."""
        tokens, rows = self.pass_settings()
        with torch.inference_mode():  # GEMMs of one shape (rows): a cache does not depend on its pass-mates
            return documents_pass(self.doc_runner.dec, self.doc_runner.rope, self.prefix_kv(), docs,
                                  max_tokens=tokens or 1, chunk=rows or None)

    def pass_settings(self) -> tuple[int, int]:
        """(rows per documents pass, 0: one document per pass; rows per GEMM, 0: one GEMM per weight) on this
        cache's device: `EngineConfig.document_pass_tokens` and `document_chunk_rows`, the latter's default resolved."""
        rows = self.config.document_chunk_rows
        if rows is None:
            rows = DOCUMENT_CHUNK_ROWS if self.doc_runner.dec.device.type == "cpu" else 0
        return self.config.document_pass_tokens, rows

    # -- serving -----------------------------------------------------------------------------------------------
    def kvs(self, docs: Sequence[Document], strategy: Strategy | None = None,
            doc_ids: Sequence[list[int]] | None = None) -> tuple[list[tuple[list[int], DocKV]], int]:
        """Each document's (token ids, cache), computing and storing what is missing; every document is registered.

        Args:
            docs: the documents, in order.
            strategy: with a `cache_variant`, that variant (`cache_variants`) replaces the plain cache; the extras
                named in its `needs_extras` are computed once by `doc_profilers` and stored with the entry.
            doc_ids: the documents' token ids when already encoded (`PromptBuilder.encode_document`).
        Returns:
            ([(ids, DocKV)] in the order of `docs`, document tokens computed (misses, variants and extras)).
        """
        out, tokens = [], 0
        variant = getattr(strategy, "cache_variant", None)
        needs = tuple(getattr(strategy, "needs_extras", ()))
        if doc_ids is None:
            doc_ids = [self.prompts.encode_document(d) for d in docs]
        if not variant:  # look every document up first, then compute the missing ones together (one pass, each
            # content once)
            keys = [content_key(self.namespace, self.prompts.prefix_ids, ids) for ids in doc_ids]
            missing: dict[str, list[int]] = {}
            found = []
            for d, ids, key in zip(docs, doc_ids, keys, strict=True):
                # a repeat of a document missing here is looked up after the first is stored (a hit, as it was)
                found.append(None if key in missing else self.store.lookup(d.id, key, len(ids)))
                if found[-1] is None:
                    missing.setdefault(key, ids)
            fresh = dict(zip(missing, self.compute_many(list(missing.values())), strict=True)) if missing else {}
        for j, (d, ids) in enumerate(zip(docs, doc_ids, strict=True)):
            if variant:  # the variant's own cache (looked up, or computed, by the variant)
                kv, n = self.cache_variants[variant](self, strategy, d, ids)
                self.register(d)
                out.append((ids, kv))
                tokens += n
                continue
            key, kv = keys[j], found[j]
            if kv is None and key not in fresh:
                kv = self.store.lookup(d.id, key, len(ids))
            if kv is None:  # computed above (or, should the store have dropped it since, now)
                kv = self.store.put(d.id, key, fresh.pop(key) if key in fresh else self.compute(ids))
                tokens += len(ids)
            missing_extras = [n for n in needs if n not in kv.extras]
            if missing_extras:
                extras = dict(kv.extras)
                for name in missing_extras:
                    extras.update(self.doc_profilers[name](self, ids, kv))
                own = kv if kv.pool is None else DocKV(kv.k.clone(), kv.v.clone())  # pooled rows get moved
                kv = self.store.put(d.id, key, DocKV(own.k, own.v, extras))
                tokens += len(ids)
            self.register(d)
            out.append((ids, kv))
        return out, tokens

    def hold(self):
        """Context manager: entries used inside it are not evicted (pooled rows are never overwritten meanwhile)."""
        return self.store.hold()

    # -- registry and eviction ---------------------------------------------------------------------------------
    def register(self, doc: Document) -> bool:
        """Adds `doc` to the registry (and its disk row) unless it is there with this body already. Returns whether
        it can be searched for (a body of at least 24 characters, `registry.HEAD`)."""
        if self.registry.known(doc):
            return True
        fp = self.registry.fingerprint(doc)
        if fp is None or not self.registry.add_fingerprint(doc.id, *fp):
            return False
        if self.store.disk is not None:
            self.store.disk.put_registration(doc.id, *fp)
        return True

    def forget(self, doc_ids: Iterable[str]) -> int:
        """Drops documents by id: their caches (memory and disk), id rows and registration. Entries held by a
        running request are dropped once released. Returns how many ids were known."""
        ids = list(doc_ids)
        if self.store.disk is not None:
            for i in ids:
                self.store.disk.forget_registration(i)
        return sum(bool(self.registry.remove(i)) | self.store.forget(i) for i in ids)

    def stats(self) -> dict[str, int]:
        """Store counters (see `FusionEngine.cache_stats`)."""
        return dict(vars(self.store.snapshot()))

    def close(self) -> None:
        self.store.close()

    # -- internals ---------------------------------------------------------------------------------------------
    def _make_store(self) -> DocStore:
        cfg, spec = self.config, self.decoder.spec
        tier = cfg.kv_tier if cfg.kv_tier != "auto" else ("pool" if self.device.type == "cuda" else "host")
        pool, budget = None, cfg.memory_budget_bytes
        if tier == "pool":
            row_bytes = spec.kv_bytes_per_token * self.decoder.embed.element_size()
            scratch = cfg.scratch_tokens or request_rows(self.context_window)
            # documents (up to the memory budget, or grown to `gpu_memory_share` of the card) and the running
            # requests' decode rows share one pool, sized to what the device has free
            wanted = max(1, cfg.memory_budget_bytes // row_bytes)
            if cfg.gpu_memory_share is not None:
                grown = share_rows(cfg.gpu_memory_share, row_bytes, self.device,
                                   decode_rows(cfg, self.context_window) + scratch)
                if grown is not None:  # a GPU: the share decides, down to one longest request
                    wanted = max(request_rows(self.context_window), grown)
            docs, decode = sized_rows(cfg, self.context_window, wanted, scratch, row_bytes, self.device)
            pool = KVPool(spec.n_layers, spec.n_kv_heads, spec.head_dim, docs + decode, scratch, self.dtype,
                          self.device)
            budget = docs * row_bytes  # the documents' share of the pool; the decode rows are the requests'
        remote = None
        if cfg.redis_url is not None:
            from .store.redis_tier import RedisTier

            # one namespace per model, tokenizer, dtype and layout: other models' entries are never seen
            remote = RedisTier(cfg.redis_url, self.namespace.digest[:32], cfg.redis_budget_bytes,
                               timeout_s=cfg.redis_timeout_s, retry_s=cfg.redis_retry_s, ttl_s=cfg.redis_ttl_s,
                               secret=cfg.cache_secret_bytes(), id_scope=self.prefix_key[:32])
        return DocStore(budget, cfg.disk_cache_dir, cfg.disk_budget_bytes, device=self.device,
                        pool=pool, pin=tier == "host" and self.device.type == "cuda", id_scope=self.prefix_key[:32],
                        id_index_bytes=cfg.id_index_bytes, disk_retry_s=cfg.disk_retry_s,
                        validate=self._validate_entry, disk_secret=cfg.cache_secret_bytes(), remote=remote)

    def _validate_entry(self, kv: DocKV, length: int | None) -> None:
        """Raises CorruptEntry when an entry read from disk can't be this model's cache of `length` tokens
        (checksums catch damage; this catches a well-formed entry of the wrong shape, dtype or extras)."""
        spec = self.decoder.spec
        want = (spec.n_layers, kv.length if length is None else length, spec.n_kv_heads, spec.head_dim)
        if tuple(kv.k.shape) != want or kv.k.dtype != self.dtype:
            raise CorruptEntry(f"entry is {tuple(kv.k.shape)} {kv.k.dtype}, the model needs {want} {self.dtype}")
        for name, t in kv.extras.items():
            if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) or (
                    t.numel() and (int(t.min()) < 0 or int(t.max()) >= kv.length)):
                raise CorruptEntry(f"extra {name!r} is not a list of token indices of this document")
