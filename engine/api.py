"""FusionEngine: question + documents in, answer out, through cached document KV. No tensor math here."""
from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .config import EngineConfig, resolve_device, resolve_dtype
from .diagnose import ContextKV
from .doccache import DocumentCache
from .fusion import DEFAULT_STRATEGY, make_strategy
from .fusion.base import Strategy
from .fusion.reuse import Reuse
from .fusion.select import reorder_documents
from .models import build_decoder
from .profile import load_profile
from .prompt import PromptBuilder, PromptLayout
from .runner import PrefillOutput, Runner, Segment
from .sampler import Sampler
from .tracing import set_attributes, span
from .store import DocKV, Namespace, fingerprint_tensors
from .types import Document, GenerationResult, GenerationStream, PrecomputeReport, as_documents
from .validate import (check_bool, check_int, check_real, check_stop, check_strategy, check_text,
                       check_token_ids)

__all__ = ["FusionEngine", "DEFAULT_MODEL"]

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>")


class _OnDocumentCache:
    """An engine attribute that lives on the engine's DocumentCache (`engine.doc_cache`), read and written through."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, engine, owner=None):
        return self if engine is None else getattr(engine.doc_cache, self.name)

    def __set__(self, engine, value) -> None:
        setattr(engine.doc_cache, self.name, value)


class FusionEngine:
    """The fusion engine over one loaded model.

    Args:
        hf_model: a transformers causal LM of a supported family (llama, mistral, qwen2, qwen3), already on
            its device and dtype.
        tokenizer: its tokenizer (with a chat template for chat models).
        config: EngineConfig.
        model_name: a display name.
        model_fingerprint / tokenizer_fingerprint: cache namespace parts; computed from the weights and the
            vocabulary when not given.

    Document caches are served by `doc_cache` (a DocumentCache, engine/doccache.py); `store`, `registry`,
    `doc_profilers`, `cache_variants`, `corpus` and `context_window` are its attributes, reachable here too.
    """

    store = _OnDocumentCache()           # DocStore: memory tier (+ disk tier)
    registry = _OnDocumentCache()        # DocumentIndex: bodies seen, found inside chat prompts
    doc_profilers = _OnDocumentCache()   # extras name -> fn(cache, ids, kv) -> {name: tensor}
    cache_variants = _OnDocumentCache()  # variant name -> fn(cache, strategy, doc, ids) -> (DocKV, tokens)
    corpus = _OnDocumentCache()          # the Corpus neighbour-based variants (fusionrag) search, or None
    context_window = _OnDocumentCache()  # tokens

    def __init__(self, hf_model, tokenizer, config: EngineConfig | None = None, *, model_name: str | None = None,
                 model_fingerprint: str | None = None, tokenizer_fingerprint: str | None = None) -> None:
        self.config = config or EngineConfig()
        self.decoder = build_decoder(hf_model)
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.model_name = model_name or getattr(hf_model.config, "_name_or_path", "") or self.decoder.spec.family
        self.device = self.decoder.device
        self.dtype = self.decoder.dtype
        self.runner = Runner(self.decoder, cuda_graphs=self.config.cuda_graphs)
        self.prompts = PromptBuilder(tokenizer, self.config.prompt)
        self.namespace = Namespace(
            model=model_fingerprint or fingerprint_tensors(hf_model.state_dict().items()),
            tokenizer=tokenizer_fingerprint or _tokenizer_fingerprint(tokenizer),
            dtype=str(self.dtype))
        self.eos_ids = _eos_ids(hf_model, tokenizer)
        sliding = getattr(hf_model.config, "sliding_window", None) if getattr(
            hf_model.config, "use_sliding_window", True) else None
        window = min(self.decoder.spec.max_positions, sliding or 1 << 62)
        self._shortest_tail = len(self.prompts.encode_tail(""))  # the question template around an empty question
        # the document caches: store, registry, offline extras and cache variants (see engine/doccache.py)
        self.doc_cache = DocumentCache(self.runner, self.prompts, self.namespace, self.config,
                                       context_window=window)
        # one request computes at a time (runner state, pool scratch rows and CUDA graph buffers are per engine);
        # held only while computing: a stream's worker holds it, never its reader (see GenerationStream)
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, name_or_path: str = DEFAULT_MODEL, *, device: str | None = None,
                        dtype: str | torch.dtype | None = None, cache_dir: str | None = None,
                        disk_cache: bool = True, **config: Any) -> FusionEngine:
        """Loads a model by registry name ("qwen2.5-coder-0.5b", "smollm2-135m", ...), GGUF path or HF folder.

        Args:
            device: "cpu", "cuda", or None for the best available.
            dtype: "bf16" (default), "fp16", "fp32".
            cache_dir: where converted weights and (with `disk_cache`) document caches live.
            disk_cache: keep document caches on disk under cache_dir/kv (shared across processes).
            **config: EngineConfig fields (memory_budget_bytes, prompt, ...).
        """
        from .weights import default_cache_dir, load_model

        dev, dt = resolve_device(device), resolve_dtype(dtype)
        model, tok, info = load_model(name_or_path, dtype=dt, device=dev, cache_dir=cache_dir)
        if disk_cache and "disk_cache_dir" not in config:
            config["disk_cache_dir"] = (cache_dir and __import__("pathlib").Path(cache_dir) or
                                        default_cache_dir()) / "kv"
        return cls(model, tok, EngineConfig(**config), model_name=info.name, model_fingerprint=info.fingerprint,
                   tokenizer_fingerprint=info.tokenizer_fingerprint)

    # -- public API ------------------------------------------------------------------------------------
    def precompute(self, docs: Iterable[Any], strategy: str | Strategy | None = None, *,
                   show_progress: bool = False) -> PrecomputeReport:
        """Computes and stores the caches of documents not stored yet; with `strategy`, also the offline data that
        strategy reads (its `needs_extras`, e.g. qcfuse's anchors, or its `cache_variant`, e.g. fusionrag's).

        Raises:
            ValueError: a document too long for any prompt (prefix + document + the shortest question + one answer
                token over the context window), naming it; checked for every document before any is computed.
        """
        docs = as_documents(docs)
        strat = None if strategy is None else make_strategy(strategy)
        with self._lock, span("kvfuse.precompute", documents=len(docs)) as sp:
            t0 = time.perf_counter()
            doc_ids = self._encode_documents(docs)
            self._check_documents_fit(docs, doc_ids)  # all of them, before any is computed
            before = self.store.snapshot()
            tokens = 0
            bar = _progress(len(docs), show_progress, "kvfuse precompute")
            for i in range(0, len(docs), 16):  # in slices: the bar moves, and only a slice is held from eviction
                with self.doc_cache.hold(), _on_device(self.device):
                    _, n = self.doc_cache.kvs(docs[i:i + 16], strat, doc_ids[i:i + 16])
                tokens += n
                bar.update(len(docs[i:i + 16]))
            bar.close()
            after = self.store.snapshot()
            set_attributes(sp, computed=after.misses - before.misses, tokens=tokens)
        return PrecomputeReport(hits=after.hits - before.hits, misses=after.misses - before.misses,
                                tokens=tokens, seconds=time.perf_counter() - t0)

    def generate(self, question: str, docs: Iterable[Any] = (), *, strategy: str | Strategy = DEFAULT_STRATEGY,
                 recompute_ratio: float = 0.15, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
                 teacher_ids: list[int] | None = None, return_logprobs: bool = False,
                 **strategy_options: Any) -> GenerationResult:
        """Answers `question` over `docs` ((id, text) pairs). See GenerationResult for what comes back.

        Args:
            teacher_ids: also score these tokens teacher-forced from the same prefill (for fidelity/KL):
                `result.extra["teacher_logprobs"]` is [T, vocab] float32 (row t: log p(. | prompt, ids[:t])).
            return_logprobs: `result.extra["logprobs"]` holds [max(1, generated), vocab] float32 log-probabilities
                of the answer's positions (row t: log p(. | prompt, answer[:t])), re-scored after decoding in one
                teacher-forced pass from the same prefill, so they equal `teacher_ids` scoring of that answer.
        """
        s = self.stream(question, docs, strategy=strategy, recompute_ratio=recompute_ratio,
                        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                        teacher_ids=teacher_ids, return_logprobs=return_logprobs, **strategy_options)
        return s._run_inline()  # on this thread: no worker, nothing to cancel

    def stream(self, question: str, docs: Iterable[Any] = (), *, strategy: str | Strategy = DEFAULT_STRATEGY,
               recompute_ratio: float = 0.15, max_new_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
               teacher_ids: list[int] | None = None, return_logprobs: bool = False,
               **strategy_options: Any) -> GenerationStream:
        """Like `generate`, yielding text deltas; the GenerationResult is `.result` once exhausted.

        Arguments are validated here, before the first delta is asked for. The request computes on a worker thread
        started by the first `next()`, into a queue the reader drains (from any thread): requests still run one at
        a time, but a slow or vanished reader never holds the engine. `close()` (or dropping the stream) cancels
        the request at the next decode step (finish_reason "cancelled"). Errors, including a prompt over the
        context window, are raised by `next()`. See GenerationStream.
        """
        opts = self._options(strategy, strategy_options, recompute_ratio, max_new_tokens, temperature, top_p, seed,
                             stop, teacher_ids, return_logprobs)
        docs = as_documents(docs)
        check_text(question, "the question")
        cancel = threading.Event()
        return GenerationStream(self._generate(question, docs, *opts, cancel), cancel=cancel)

    def chat(self, messages: Iterable[Any], documents: Iterable[Any] = (), *,
             strategy: str | Strategy = DEFAULT_STRATEGY, recompute_ratio: float = 0.15, max_new_tokens: int = 64,
             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
             return_logprobs: bool = False, **strategy_options: Any) -> GenerationResult:
        """Answers a chat (system / user / assistant turns, through the model's chat template), fusing every
        registered document found inside it.

        A framework's stock RAG path stuffs retrieved text into one prompt; here that prompt is searched for the
        bodies of documents the engine has seen (`precompute`, `register`, earlier requests) and for `documents`,
        and each one found is served from its cache (re-positioned, `recompute_ratio` of it recomputed by
        `strategy`); everything else (instructions, titles, metadata, the question, earlier turns) is computed.
        With no document found it is a plain chat completion. `GenerationResult.cache_hits` etc. count the
        documents found; `extra["documents"]` lists their ids.

        Args:
            messages: `{"role": "system" | "user" | "assistant", "content": str}` in order, the last one a user
                turn (or a string: one user turn).
            documents: documents to look for besides the registered ones (also registered from now on).
            Other arguments: as `generate`.
        """
        s = self.stream_chat(messages, documents, strategy=strategy, recompute_ratio=recompute_ratio,
                             max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                             stop=stop, return_logprobs=return_logprobs, **strategy_options)
        return s._run_inline()

    def stream_chat(self, messages: Iterable[Any], documents: Iterable[Any] = (), *,
                    strategy: str | Strategy = DEFAULT_STRATEGY, recompute_ratio: float = 0.15,
                    max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                    stop: list[str] | None = None, return_logprobs: bool = False,
                    **strategy_options: Any) -> GenerationStream:
        """`chat` as a stream of text deltas (see `stream`)."""
        opts = self._options(strategy, strategy_options, recompute_ratio, max_new_tokens, temperature, top_p, seed,
                             stop, None, return_logprobs)
        msgs = _check_messages(messages)
        docs = as_documents(documents)
        cancel = threading.Event()
        return GenerationStream(self._generate("", docs, *opts, cancel, messages=msgs), cancel=cancel)

    def register(self, docs: Iterable[Any]) -> int:
        """Remembers documents so that chat prompts containing their bodies are fused (no computation; `precompute`
        registers too). Returns how many can be searched for (bodies of at least 24 characters)."""
        return sum(self.doc_cache.register(d) for d in as_documents(docs))

    def forget(self, doc_ids: Iterable[str]) -> int:
        """Evicts documents by id: their caches in memory and on disk, their id rows and their registration.
        Returns how many ids were known. Entries in use by a running request are left to it and dropped after."""
        ids = [check_text(i, "a document id") for i in ([doc_ids] if isinstance(doc_ids, str) else doc_ids)]
        with self._lock:
            return self.doc_cache.forget(ids)

    def _options(self, strategy, strategy_options, recompute_ratio, max_new_tokens, temperature, top_p, seed, stop,
                 teacher_ids, return_logprobs) -> tuple:
        """Validates a request's options; returns (strategy, ratio, max_new, sampler, stop, teacher, return_logprobs),
        the middle arguments of `_generate`."""
        strat = check_strategy(strategy, strategy_options)
        recompute_ratio = check_real(recompute_ratio, "recompute_ratio", low=0.0, high=1.0)
        room = self.context_window - len(self.prompts.prefix_ids) - 1  # beside the prefix and >= 1 question token
        max_new_tokens = check_int(max_new_tokens, "max_new_tokens", minimum=1, maximum=room)
        sampler = Sampler(temperature, top_p, seed)
        stop = check_stop(stop)
        check_bool(return_logprobs, "return_logprobs")
        teacher = None if teacher_ids is None else torch.as_tensor(check_token_ids(
            teacher_ids, "teacher_ids", self.decoder.spec.vocab, max_len=room), dtype=torch.long)
        return strat, recompute_ratio, max_new_tokens, sampler, stop, teacher, return_logprobs

    def next_token_logprobs(self, question: str, docs: Iterable[Any], target_ids, *,
                            strategy: str | Strategy = "full", recompute_ratio: float = 0.15) -> torch.Tensor:
        """Teacher-forced log-probabilities: row t is log p(. | prompt, target[:t]).

        Returns:
            [T, vocab] float32 on the CPU.
        """
        strat = check_strategy(strategy, {})
        recompute_ratio = check_real(recompute_ratio, "recompute_ratio", low=0.0, high=1.0)
        room = self.context_window - len(self.prompts.prefix_ids) - 1  # beside the prefix and >= 1 question token
        target = torch.as_tensor(check_token_ids(target_ids, "target_ids", self.decoder.spec.vocab, allow_empty=False,
                                                 max_len=room), dtype=torch.long)
        docs = as_documents(docs)
        check_text(question, "the question")
        with self._lock, self.store.hold():
            doc_ids = self._encode_documents(docs)
            layout, segs, _ = self._prepare(question, docs, strat, doc_ids, reserve=int(target.numel()))
            layout, segs, _ = self._reorder(question, docs, strat, recompute_ratio, layout, segs, doc_ids,
                                            reserve=int(target.numel()))
            out = self.runner.prefill(layout.ids, segs, strat, recompute_ratio, extra_capacity=int(target.numel()))
            rows = [out.logits[None]]
            if target.numel() > 1:
                rows.append(self.runner.extend(out.state, target[:-1]))
            return torch.log_softmax(torch.cat(rows).float(), dim=-1).cpu()

    def context_kv(self, question: str, docs: Iterable[Any]) -> ContextKV:
        """The documents' cached K/V next to what full prefill of this prompt computes for the same rows.

        Looks up (or computes) each document's cache as `reuse` would, then runs one full prefill and keeps the
        in-context K/V of the document rows. Both are pre-RoPE; comparing them shows how much each token, at
        each layer, is changed by the documents before it (`ContextKV.relative_deviation`). Costs one full
        prefill; for analysis, not serving.

        Raises:
            ValueError: no documents, or the prompt does not fit the context window.
        """
        docs = [Document(d.id, d.text) for d in as_documents(docs)]  # bodies only: the rows compared are theirs
        if not docs:
            raise ValueError("context_kv needs at least one document")
        full, reuse = make_strategy("full"), Reuse()
        with self._lock, self.store.hold():
            doc_ids = self._encode_documents(docs)
            layout, segs, _ = self._prepare(question, docs, full, doc_ids)
            start, end = layout.docs[0].start, layout.docs[-1].end
            ctx = self.runner.prefill(layout.ids, segs, full, 1.0, capture=(start, end), want_logits=False).captured
            _, cached, _ = self._prepare(question, docs, reuse, doc_ids)
            alone = [s.kv for s in cached if s.selectable]
            k = torch.cat([kv.k for kv in alone], dim=1)
            v = torch.cat([kv.v for kv in alone], dim=1)
            return ContextKV(layout, k, v, ctx.k.to(k.device), ctx.v.to(v.device))

    def cache_stats(self) -> dict[str, int]:
        """Store counters: hits, misses, stale, disk_hits, corrupt (bad disk rows dropped), evictions, memory_bytes,
        memory_entries, disk_errors (failed disk operations, served from memory or recomputed instead),
        disk_degraded (1 while the disk tier is paused after a failure), id_index_bytes."""
        return self.doc_cache.stats()

    def layout(self, question: str, docs: Iterable[Any]) -> PromptLayout:
        """The token layout a request would use (no computation)."""
        docs = as_documents(docs)
        return self.prompts.build(question, [self.prompts.encode_document(d) for d in docs],
                                  [self.prompts.encode_title(d) for d in docs])

    def close(self) -> None:
        self.doc_cache.close()

    # -- internals -------------------------------------------------------------------------------------
    def _acquire(self, cancel: threading.Event | None) -> bool:
        """Takes the engine lock; with `cancel`, gives up (False) once it is set while waiting."""
        if cancel is None:
            self._lock.acquire()
            return True
        while not self._lock.acquire(timeout=0.05):
            if cancel.is_set():
                return False
        if cancel.is_set():
            self._lock.release()
            return False
        return True

    def _encode_documents(self, docs: list[Document]) -> list[list[int]]:
        """Each document's token ids (`PromptBuilder.encode_document`): the one tokenization of a request."""
        return [self.prompts.encode_document(d) for d in docs]

    def _check_documents_fit(self, docs: list[Document], doc_ids: list[list[int]]) -> None:
        """Raises ValueError naming every document that fits no prompt: prefix + document + the shortest question
        tail (the question template around an empty question) + 1 answer token over the context window."""
        fixed = len(self.prompts.prefix_ids) + self._shortest_tail + 1
        over = [(d.id, len(ids)) for d, ids in zip(docs, doc_ids) if fixed + len(ids) > self.context_window]
        if over:
            what = _name_documents(over)
            raise ValueError(f"{what} too long for any prompt: with the prompt's prefix, the shortest question and "
                             f"one answer token ({fixed} tokens) it is over the model's context window of "
                             f"{self.context_window} tokens")

    def _check_fits(self, layout: PromptLayout, docs: list[Document], reserve: int) -> None:
        """Raises ValueError when the prompt + `reserve` answer tokens are over the context window, naming the
        documents that are too long even alone in it."""
        n = layout.n + reserve
        if n <= self.context_window:
            return
        fixed = len(layout.prefix) + len(layout.tail) + reserve
        over = [(d.id, len(sp)) for d, sp in zip(docs, layout.docs) if fixed + len(sp) > self.context_window]
        if over:
            raise ValueError(f"{_name_documents(over)} too long: with the prompt's prefix and question "
                             f"({fixed - reserve} tokens) and {reserve} answer tokens it is over the model's "
                             f"context window of {self.context_window} tokens")
        raise ValueError(f"prompt + answer is {n} tokens (prefix {len(layout.prefix)}, {len(layout.docs)} documents "
                         f"{layout.doc_tokens}, question {len(layout.tail)}, answer {reserve}), over the model's "
                         f"context window of {self.context_window} tokens")

    def _prepare(self, question: str, docs: list[Document], strat: Strategy, doc_ids: list[list[int]] | None = None,
                 reserve: int = 0):
        """Lays out the prompt, checks that it and `reserve` answer tokens fit the context window (before any
        lookup or model work), looks up (computing misses) and returns (layout, segments, seconds spent on misses).

        `doc_ids`: the documents' token ids when already encoded (`_encode_documents`); tokenized here otherwise.
        """
        if doc_ids is None:
            doc_ids = self._encode_documents(docs)
        layout = self.prompts.build(question, doc_ids, [self.prompts.encode_title(d) for d in docs])
        return self._lay_out(layout, docs, doc_ids, strat, reserve)

    def _lay_out(self, layout: PromptLayout, docs: list[Document], doc_ids: list[list[int]], strat: Strategy,
                 reserve: int, keep: list[int | None] | None = None):
        """Checks the layout against the window, then serves its documents (computing misses) and returns
        (layout, segments in prompt order, seconds spent on misses). Prefix: cached when it is the engine's fixed
        prefix; documents: cached (selectable); glue and tail: computed. `keep[i]`: serve only the first rows of
        document i's cache (a body found without the suffix it was cached with)."""
        t0 = time.perf_counter()
        self._check_fits(layout, docs, reserve)
        if hasattr(strat, "use_model_profile"):  # e.g. qcfuse's critical layers, found offline per model
            strat.use_model_profile(load_profile(self))
        miss_tokens, kvs = 0, [None] * len(docs)
        if strat.uses_cache:
            pairs, miss_tokens = self.doc_cache.kvs(docs, strat, doc_ids)
            kvs = [kv if not n else _head(kv, n) for (_, kv), n in zip(pairs, keep or [None] * len(pairs))]
        prefix_kv = self.doc_cache.prefix_kv() if strat.uses_cache and layout.prefix_cached else None
        segs = [Segment(layout.prefix.start, layout.prefix.end, prefix_kv, selectable=False)]
        segs += [Segment(sp.start, sp.end, kv) for sp, kv in zip(layout.docs, kvs)]
        segs += [Segment(sp.start, sp.end, None, selectable=False) for sp in layout.glue]
        segs.sort(key=lambda sg: sg.start)
        segs.append(Segment(layout.tail.start, layout.tail.end, None, selectable=False))
        miss_s = time.perf_counter() - t0 if miss_tokens else 0.0
        return layout, segs, miss_s

    def _prepare_chat(self, messages: list[dict[str, str]], extra: list[Document], strat: Strategy, reserve: int):
        """A chat request: registered documents (and `extra`) found by content inside the messages are served from
        their caches, the rest of the rendered chat template is computed. Returns what `_prepare` returns, and the
        documents found (prompt order)."""
        rendered, found, doc_ids = [], [], []
        suffix = self.prompts.fmt.doc_suffix
        for m in messages:
            content, parts, at = m["content"], [], 0
            for match in self.registry.find(content, extra):
                end = match.end
                with_suffix = bool(suffix) and content.startswith(suffix, end)
                parts.append(content[at:match.start])
                parts.append(_DOC_SLOT.format(len(found)))
                found.append(match.doc)
                full = self.prompts.encode_document(match.doc)
                if with_suffix:
                    doc_ids.append((full, None, []))
                else:  # the body alone: the first rows of the body + suffix cache, as far as their tokens agree
                    body = self.prompts.encode_body(match.doc)  # (".\n\n" may be one token: the rest is computed)
                    same = next((i for i, (a, b) in enumerate(zip(full, body)) if a != b), min(len(full), len(body)))
                    doc_ids.append((full, same, body[same:]) if same else (body, None, []))
                at = end + (len(suffix) if with_suffix else 0)
            parts.append(content[at:])
            rendered.append({"role": m["role"], "content": "".join(parts)})
        text = self.prompts.render_chat(rendered)
        pieces: list[tuple[str, list[int]]] = []
        for i, chunk in enumerate(_DOC_SPLIT.split(text)):
            if i % 2 == 0:
                pieces.append(("text", self.prompts.encode_text(chunk)))
            else:
                ids, keep, rest = doc_ids[int(chunk)]
                pieces.append(("doc", ids[:keep] if keep is not None else ids))
                if rest:
                    pieces.append(("text", rest))
        if not pieces[0][1]:
            raise ValueError("a chat prompt must not start with a document: nothing would precede it")
        if not pieces[-1][1]:
            raise ValueError("a chat prompt must end with text after its last document (the chat template's "
                             "assistant header)")
        layout = PromptLayout.from_pieces(pieces, prefix_cached=False)
        order = [int(c) for i, c in enumerate(_DOC_SPLIT.split(text)) if i % 2]
        found = [found[j] for j in order]
        return (*self._lay_out(layout, found, [doc_ids[j][0] for j in order], strat, reserve,
                               keep=[doc_ids[j][1] for j in order]), found)

    def _reorder(self, question: str, docs: list[Document], strat: Strategy, ratio: float, layout, segs,
                 doc_ids: list[list[int]] | None = None, reserve: int = 0):
        """For a strategy with `reorders_documents` (infoflow's reorder): one selection pass over the given order,
        then the prompt again in the order `strat.document_order` asks for. Returns (layout, segs, seconds)."""
        if not getattr(strat, "reorders_documents", False) or len(docs) < 2:
            return layout, segs, 0.0
        t0 = time.perf_counter()
        if doc_ids is None:
            doc_ids = [d.tolist() for d in layout.doc_ids]
        order = reorder_documents(self.runner, layout, segs, list(range(len(docs))), strat, ratio)
        layout, segs, _ = self._prepare(question, [docs[i] for i in order], strat, [doc_ids[i] for i in order],
                                        reserve)
        return layout, segs, time.perf_counter() - t0

    def _generate(self, question: str, docs: list[Document], strat: Strategy, ratio: float, max_new: int,
                  sampler: Sampler, stop: list[str], teacher: torch.Tensor | None = None,
                  return_logprobs: bool = False, cancel: threading.Event | None = None, *,
                  messages: list[dict[str, str]] | None = None) -> Iterator[str]:
        """Yields the answer's text deltas and returns its GenerationResult, holding the engine lock throughout.

        `cancel` (a stream's): waited on while the lock is busy, and checked before every decode step; once set,
        decoding ends (finish_reason "cancelled", no final delta, no logprob re-scoring) and the lock is released.
        Cancelled before the lock was taken: returns None, having computed nothing."""
        extra: dict[str, Any] = {}
        t_call = time.perf_counter()
        if not self._acquire(cancel):
            return None
        try:
            t_start = time.perf_counter()
            n_teacher = 0 if teacher is None else int(teacher.numel())
            reserve = max(max_new, n_teacher)
            with self.store.hold(), _on_device(self.device):
                with span("kvfuse.prefill", strategy=strat.name, recompute_ratio=ratio, documents=len(docs),
                          chat=messages is not None) as sp:
                    before = self.store.snapshot()
                    if messages is None:
                        doc_ids = self._encode_documents(docs)
                        layout, segs, miss_s = self._prepare(question, docs, strat, doc_ids, reserve)
                        t_prefill = time.perf_counter()
                        layout, segs, reorder_s = self._reorder(question, docs, strat, ratio, layout, segs, doc_ids,
                                                                reserve)
                    else:  # a chat: documents found by content, no reordering (the user's text stays as written)
                        layout, segs, miss_s, found = self._prepare_chat(messages, docs, strat, reserve)
                        extra["documents"] = [d.id for d in found]
                        t_prefill, reorder_s = time.perf_counter(), 0.0
                    out: PrefillOutput = self.runner.prefill(layout.ids, segs, strat, ratio, extra_capacity=reserve)
                    token = sampler(out.logits)
                    t_first = time.perf_counter()
                    after = self.store.snapshot()
                    set_attributes(sp, prompt_tokens=layout.n, doc_tokens=layout.doc_tokens,
                                   recomputed_tokens=int(out.recomputed.numel()), cache_hits=after.hits - before.hits,
                                   cache_misses=after.misses - before.misses, queue_s=t_start - t_call,
                                   ttft_s=t_first - t_call)
                if n_teacher:
                    rows = [out.logits[None]]
                    if n_teacher > 1:
                        rows.append(self.runner.extend(out.state, teacher[:-1]))
                        out.state.length = layout.n  # decoding overwrites the teacher rows
                    extra["teacher_logprobs"] = torch.log_softmax(torch.cat(rows).float(), dim=-1).cpu()
                tokens, text, emitted, finish = [], "", 0, "length"
                while True:
                    if token in self.eos_ids:
                        finish = "stop"
                        break
                    tokens.append(token)
                    text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                    cut = _first_stop(text, stop)
                    if cut is not None:
                        text, finish = text[:cut], "stop"
                        break
                    safe = len(text) - _held_back(text, stop)
                    if safe > emitted:
                        yield text[emitted:safe]
                        emitted = safe
                    if len(tokens) >= max_new:
                        break
                    if cancel is not None and cancel.is_set():  # the reader closed or dropped the stream
                        finish = "cancelled"
                        break
                    logits = self.runner.extend(out.state, torch.tensor([token]))[0]
                    token = sampler(logits)
                if len(text) > emitted and finish != "cancelled":
                    yield text[emitted:]
                t_end = time.perf_counter()
                if return_logprobs and finish != "cancelled":  # the answer re-scored in one pass, as `teacher_ids`
                    rows = [out.logits[None]]
                    if len(tokens) > 1:
                        out.state.length = layout.n
                        rows.append(self.runner.extend(out.state, torch.tensor(tokens[:-1])))
                    extra["logprobs"] = torch.log_softmax(torch.cat(rows).float(), dim=-1).cpu()
        finally:
            self._lock.release()
        return GenerationResult(
            text=text, token_ids=tokens, strategy=strat.name,
            recompute_ratio=1.0 if not strat.uses_cache else (0.0 if strat.ignores_ratio else ratio),
            finish_reason=finish, ttft_s=t_first - t_call, queue_s=t_start - t_call, prefill_s=t_first - t_prefill,
            decode_s=t_end - t_first, selection_s=out.selection_s + reorder_s, miss_prefill_s=miss_s,
            prompt_tokens=layout.n, doc_tokens=layout.doc_tokens, question_tokens=len(layout.tail),
            recomputed_tokens=int(out.recomputed.numel()) if strat.uses_cache else layout.doc_tokens,
            cache_hits=after.hits - before.hits, cache_misses=after.misses - before.misses,
            stale=after.stale - before.stale, extra=extra,
            recomputed_positions=out.recomputed.tolist() if strat.uses_cache else [],
            doc_spans=[(sp.start, sp.end) for sp in layout.docs])


_DOC_SLOT = "\x00KVFUSE-DOC-{}\x00"
_DOC_SPLIT = re.compile("\x00KVFUSE-DOC-([0-9]+)\x00")


def _head(kv: DocKV, n: int) -> DocKV:
    """The first n rows of a cached document (rows do not depend on what follows them); index extras trimmed."""
    extras = {name: t[t < n] for name, t in kv.extras.items()}
    return DocKV(kv.k[:, :n], kv.v[:, :n], extras, kv.pool, kv.offset)


def _check_messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages as `{"role", "content"}` dicts (a string is one user turn); ValueError naming the bad one."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if isinstance(messages, Mapping) or not isinstance(messages, Iterable):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} mappings, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a mapping with 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{i}]: role must be 'system', 'user' or 'assistant', got {m['role']!r}")
        out.append({"role": m["role"], "content": check_text(m["content"], f"messages[{i}] content",
                                                              allow_empty=m["role"] != "user")})
    if not out or out[-1]["role"] != "user":
        raise ValueError("messages must end with a user turn")
    return out


def _progress(total: int, show: bool, desc: str):
    """A tqdm bar over `total` items when `show`, else an object with the same update/close that does nothing."""
    if show:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="doc")
    return _NoBar()


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _on_device(device: torch.device):
    """Makes `device` the thread's current CUDA device for the block (a stream computes on its own thread)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _name_documents(docs: list[tuple[str, int]]) -> str:
    """ "document 'a' (812 tokens) is" / "documents 'a' (812 tokens), 'b' (901 tokens) are each" """
    if len(docs) == 1:
        return f"document {docs[0][0]!r} ({docs[0][1]} tokens) is"
    return "documents " + ", ".join(f"{i!r} ({n} tokens)" for i, n in docs) + " are each"


def _first_stop(text: str, stop: list[str]) -> int | None:
    hits = [text.find(s) for s in stop if s and s in text]
    return min(hits) if hits else None


def _held_back(text: str, stop: list[str]) -> int:
    """Characters to hold back: an incomplete UTF-8 sequence, or a suffix that may start a stop string."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def _eos_ids(hf_model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen = getattr(hf_model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(x) for x in src)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in _END_OF_TURN if t in vocab)
    return ids


def _tokenizer_fingerprint(tokenizer) -> str:
    import hashlib

    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    for tok in sorted(vocab):
        h.update(f"{tok}\x00{vocab[tok]}\x01".encode("utf-8", "surrogatepass"))
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()[:32]
