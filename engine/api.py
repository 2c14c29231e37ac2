"""FusionEngine: question + documents in, answer out, through cached document KV. No tensor math here."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .auto import Choice, Front, TtftRate, packaged_front
from .adapter import FusionAdapter, load_adapter, merge_into, resolve_adapter
from .links import LinkRows, applies_to, load_links, placeholder_ids, resolve_links
from .config import EngineConfig, resolve_device, resolve_dtype
from .diagnose import ContextKV
from .doccache import DocumentCache
from .fusion import make_strategy
from .fusion.base import Strategy
from .fusion.coinrag import sentence_spans
from .fusion.reuse import Reuse
from .fusion.select import reorder_documents, select_only
from .models import build_decoder
from .options import GenerationOptions
from .profile import load_profile
from .prompt import PromptBuilder, PromptLayout, Span
from .decode import Arena, Decoding, sized_rows
from .runner import Runner, Segment
from .scheduler import Request, Scheduler
from .sampler import Sampler
from .sift import IndexStore, compute_index, compute_indexes, sparse_plan
from .tracing import set_attributes, span
from .store import DocKV, Namespace, fingerprint_tensors
from .store.keys import content_key
from .store.pool import KVPool
from .types import AsyncGenerationStream, Document, GenerationResult, GenerationStream, PrecomputeReport, as_documents
from .validate import check_int, check_real, check_strategy, check_text, check_token_ids

__all__ = ["FusionEngine", "DEFAULT_MODEL"]

#: Most documents whose sift index, or whose cache (cold documents), waits to be built between requests (each
#: backlog drops its oldest beyond it).
MAX_INDEX_BACKLOG = 4096
DEFAULT_FUSED_REL = 0.5  # a fused prefill's TTFT / full's, where the model's front has no measured point


def _wait_until(done, timeout: float) -> bool:
    """Polls `done()` every 10 ms until it is true (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return done()

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
        adapter: a fusion adapter (engine/adapter.py: a FusionAdapter or the path of its safetensors file); None
            for none. An offline one computes the documents' caches; an online one computes the rows fused
            prefills compute (`fused_runner`, merged weights). Its hash is part of every cache key.
        links: link rows (engine/links.py: a LinkRows or the path of its safetensors file); None for none. Their
            K learned rows follow every cached document of a fused request's prompt and are computed with it;
            caches do not change with them.

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
                 model_fingerprint: str | None = None, tokenizer_fingerprint: str | None = None,
                 adapter: FusionAdapter | str | Path | None = None, links: LinkRows | str | Path | None = None
                 ) -> None:
        self.config = config or EngineConfig()
        self.decoder = build_decoder(hf_model)
        _check_on_device(hf_model, self.decoder.device)
        if links is not None and not isinstance(links, LinkRows):
            links = load_links(links)
        if links is not None:  # before any runner copies the decoder: every copy embeds the placeholders
            links.check(self.decoder.spec.hidden)
            self.decoder.links = links.vectors.detach().to(self.decoder.device, self.decoder.dtype)
        self.links = links
        self._link_ids = placeholder_ids(self.decoder.spec.vocab, links.k) if links is not None else None
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.model_name = model_name or getattr(hf_model.config, "_name_or_path", "") or self.decoder.spec.family
        self.device = self.decoder.device
        self.dtype = self.decoder.dtype
        self.runner = Runner(self.decoder, cuda_graphs=self.config.cuda_graphs,
                             piecewise_graphs=self.config.piecewise_graphs,
                             bucketed=self.config.bucketed_prefill, idle_captures=self.config.idle_captures)
        self.prompts = PromptBuilder(tokenizer, self.config.prompt)
        if adapter is not None and not isinstance(adapter, FusionAdapter):
            adapter = load_adapter(adapter)
        if adapter is not None:
            adapter.check(self.decoder)
            adapter = adapter.to(self.device, self.dtype)
        self.adapter = adapter
        self.namespace = Namespace(
            model=model_fingerprint or fingerprint_tensors(hf_model.state_dict().items()),
            tokenizer=tokenizer_fingerprint or _tokenizer_fingerprint(tokenizer),
            dtype=str(self.dtype), adapter=adapter.digest if adapter is not None else "")
        self.eos_ids = _eos_ids(hf_model, tokenizer)
        # strategy="auto": the measured front of this model and adapter (None: auto refuses, naming why), and the
        # full-prefill seconds per token it predicts TTFT with, learned from this engine's requests
        self.front: Front | None = packaged_front(self.model_name, adapter.digest[:16] if adapter is not None else "")
        self.ttft_rate = TtftRate()
        sliding = getattr(hf_model.config, "sliding_window", None) if getattr(
            hf_model.config, "use_sliding_window", True) else None
        window = min(self.decoder.spec.max_positions, sliding or 1 << 62)
        self._shortest_tail = len(self.prompts.empty_tail)  # the question template around an empty question
        # the document caches: store, registry, offline extras and cache variants (see engine/doccache.py)
        # an offline adapter computes the documents (so no cache is exact); fused prefills (strategies that read
        # caches) with an online one run the merged weights; `full`, sift and decoding stay the base model
        self._documents_adapted = adapter is not None and adapter.stage == "offline"
        # (merged weights: W + scale * B @ A computed once, so a document costs what the base model's prefill costs,
        # not seven more pairs of thin GEMMs per layer; engine/adapter.py's AdaptedDecoder stays training's form)
        doc_runner = (Runner(merge_into(self.decoder, adapter), cuda_graphs=False) if self._documents_adapted
                      else None)
        self.fused_runner = self.runner if adapter is None or self._documents_adapted else Runner(
            merge_into(self.decoder, adapter), cuda_graphs=self.config.cuda_graphs,
            piecewise_graphs=self.config.piecewise_graphs, bucketed=self.config.bucketed_prefill,
            idle_captures=self.config.idle_captures)
        self.doc_cache = DocumentCache(self.runner, self.prompts, self.namespace, self.config,
                                       context_window=window, doc_runner=doc_runner)
        # requests run on the scheduler's thread, decoded together (engine/scheduler.py); other model work takes
        # the engine between two of its iterations (`self.scheduler.exclusive()`)
        self.sift_indexes = IndexStore()  # sift's selective indexes, apart from the K/V caches (engine/sift.py)
        self.dense_strategy = make_strategy("full")  # what a sift request attending densely prefills as (`_reorder`)
        self._index_backlog: collections.OrderedDict = collections.OrderedDict()  # key -> (ids, index params)
        # caches a request skipped (cold documents answered by full prefill): key -> (document, ids, strategy)
        self._cache_backlog: collections.OrderedDict = collections.OrderedDict()
        self.decoding = Decoding(self.runner, self._make_arena(), self.config.cuda_graphs)
        cpu_threads = self.config.scheduler_cpu_threads
        if cpu_threads is None and self.device.type != "cpu":
            cpu_threads = 1
        self.scheduler = Scheduler(self, self.decoding, self.config.max_batch_size, self.config.max_queued_requests,
                                   self.config.prefill_tokens_per_step, cpu_threads=cpu_threads)

    @classmethod
    def from_pretrained(cls, name_or_path: str = DEFAULT_MODEL, *, device: str | None = None,
                        dtype: str | torch.dtype | None = None, cache_dir: str | None = None,
                        disk_cache: bool = True, adapter: FusionAdapter | str | Path | None = "auto",
                        links: LinkRows | str | Path | None = "auto", **config: Any) -> FusionEngine:
        """Loads a model by registry name ("qwen2.5-coder-0.5b", "smollm2-135m", ...), GGUF path or HF folder.

        Args:
            device: "cpu", "cuda", or None for the best available.
            dtype: "bf16", "fp16", "fp32", or None: bf16 on CUDA and on CPUs with native bf16 matmul, fp32 on
                other CPUs (where bf16 is emulated, 50-100x slower).
            cache_dir: where converted weights and (with `disk_cache`) document caches live.
            disk_cache: keep document caches on disk under cache_dir/kv (shared across processes).
            adapter: "auto" (the default: the fusion adapter shipped for this model when there is one, as for the
                embedded model; none otherwise), None (no adapter: the base model everywhere), "packaged" (the
                shipped one: ValueError when there is none), a .safetensors path or a FusionAdapter.
            links: the same choices for link rows (engine/links.py): "auto" (the default: those shipped for this
                model when there are some), None, "packaged", a .safetensors path or a LinkRows.
            **config: EngineConfig fields (memory_budget_bytes, prompt, redis_url, ...).
        """
        from .weights import default_cache_dir, load_model

        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        model, tok, info = load_model(name_or_path, dtype=dt, device=dev, cache_dir=cache_dir)
        if disk_cache and "disk_cache_dir" not in config:
            config["disk_cache_dir"] = (cache_dir and __import__("pathlib").Path(cache_dir) or
                                        default_cache_dir()) / "kv"
        adapter = resolve_adapter(adapter, info.name)
        links = resolve_links(links, info.name)
        return cls(model, tok, EngineConfig(**config), model_name=info.name, model_fingerprint=info.fingerprint,
                   tokenizer_fingerprint=info.tokenizer_fingerprint, adapter=adapter, links=links)

    # -- public API ------------------------------------------------------------------------------------
    def precompute(self, docs: Iterable[Any], strategy: str | Strategy | None = None, *,
                   show_progress: bool = False) -> PrecomputeReport:
        """Computes and stores the caches of documents not stored yet; with `strategy`, also the offline data that
        strategy reads (its `needs_extras`, e.g. qcfuse's anchors, or its `cache_variant`, e.g. fusionrag's).
        Documents may be given as text or as token ids (`Document(id, token_ids=...)`).

        Raises:
            ValueError: a document too long for any prompt (prefix + document + the shortest question + one answer
                token over the context window), naming it; checked for every document before any is computed.
        """
        strat = None if strategy is None else make_strategy(strategy)
        docs = self._documents(docs, strat)
        if getattr(strat, "sparse_index", False):  # sift: indexes only, never a K/V entry
            return self._precompute_indexes(docs, strat)[0]
        with self.scheduler.exclusive(), span("kvfuse.precompute", documents=len(docs)) as sp:
            t0 = time.perf_counter()
            doc_ids = self._encode_documents(docs)
            self._check_documents_fit(docs, doc_ids)  # all of them, before any is computed
            self.doc_cache.pool.add(docs)
            before = self.store.snapshot()
            tokens = 0
            bar = _progress(len(docs), show_progress, "kvfuse precompute")
            for i in range(0, len(docs), 16):  # in slices: the bar moves, and only a slice is held from eviction
                with self.doc_cache.hold(), _on_device(self.device):
                    _, n = self.doc_cache.kvs(docs[i:i + 16], strat, doc_ids[i:i + 16])
                    if getattr(strat, "cache_variant", None) and not self._documents_adapted:
                        # any document may come first in a prompt, where its plain cache is served (exact)
                        n += self.doc_cache.kvs(docs[i:i + 16], None, doc_ids[i:i + 16])[1]
                tokens += n
                bar.update(len(docs[i:i + 16]))
            bar.close()
            after = self.store.snapshot()
            set_attributes(sp, computed=after.misses - before.misses, tokens=tokens)
        return PrecomputeReport(hits=after.hits - before.hits, misses=after.misses - before.misses,
                                tokens=tokens, seconds=time.perf_counter() - t0)

    def _precompute_indexes(self, docs: list[Document], strat, with_bytes: bool = False):
        """(PrecomputeReport, each document's serialised index or None) of one pass over `docs`."""
        t0 = time.perf_counter()
        with span("kvfuse.precompute", documents=len(docs), strategy=strat.name):
            found = self._index_documents(docs, strat)
        hits = sum(hit for *_, hit in found)
        tokens = sum(len(ids) for ids, _, _, hit in found if not hit)
        report = PrecomputeReport(hits=hits, misses=len(docs) - hits, tokens=tokens, seconds=time.perf_counter() - t0)
        return report, ([idx.to_bytes(key) for _, key, idx, _ in found] if with_bytes else None)

    def _index_documents(self, docs: list[Document], strat) -> list[tuple[list[int], str, Any, bool]]:
        """Every document's (token ids, index key, index, hit), computing the missing indexes; checked to fit the
        context window first (all of them, before any is computed)."""
        with self.scheduler.exclusive(), _on_device(self.device):
            doc_ids = self._encode_documents(docs)
            self._check_documents_fit(docs, doc_ids)
            keys = [self._sift_key(ids, strat) for ids in doc_ids]
            built = self._build_indexes(doc_ids, keys, strat)
            out = []
            for ids, key in zip(doc_ids, keys, strict=True):
                if key in built:  # computed now: a miss (a repeat of it later in the list is a hit)
                    out.append((ids, key, built.pop(key), False))
                else:
                    out.append((ids, key, *self._sift_index(ids, strat, key)))
            return out

    def _build_indexes(self, doc_ids: list[list[int]], keys: list[str], strat) -> dict[str, Any]:
        """The missing indexes among `keys`, computed together (engine/sift.py `compute_indexes`: the documents in
        one pass) and stored; key -> index of those computed."""
        missing = {}
        for ids, key in zip(doc_ids, keys, strict=True):
            if key not in missing and self.sift_indexes.get(key) is None:
                missing[key] = ids
        if not missing:
            return {}
        built = dict(zip(missing, compute_indexes(self, list(missing.values()), strat.block, strat.local_mass,
                                                  strat.cross_mass), strict=True))
        for key, idx in built.items():
            self.sift_indexes.put(key, idx)
        return built

    def generate(self, question: str | None = None, docs: Iterable[Any] = (),
                 options: GenerationOptions | None = None, *, question_ids: Sequence[int] | None = None,
                 **kwargs: Any) -> GenerationResult:
        """Answers `question` over `docs` ((id, text) pairs, mappings or Documents, text or token ids). See
        GenerationResult for what comes back.

        Args:
            question: the question, as text.
            docs: the retrieved documents, in prompt order.
            options: GenerationOptions (strategy, recompute_ratio, max_new_tokens, sampling, stop, teacher_ids,
                return_logprobs, strategy options); the defaults when None.
            question_ids: instead of `question`, the prompt's tail as token ids, used as given (no tokenizer call):
                what `engine.prompts.encode_tail(question)` gives for a text question, i.e. the question inside
                the prompt format's question template, followed by the assistant header. With documents given as
                `Document(id, token_ids=...)`, a request is tokenized nowhere (titles aside).
            **kwargs: GenerationOptions fields by name (`strategy=`, `max_new_tokens=`, `teacher_ids=`, ...), which
                override those of `options`; any other keyword is a strategy option (`gradual=True`).
                `teacher_ids`: also score these tokens teacher-forced from the same prefill (for fidelity/KL):
                `result.extra["teacher_logprobs"]` is [T, vocab] float32 (row t: log p(. | prompt, ids[:t])).
                `return_logprobs`: `result.extra["logprobs"]` holds [max(1, generated), vocab] float32
                log-probabilities of the answer's positions (row t: log p(. | prompt, answer[:t])), re-scored after
                decoding in one teacher-forced pass from the same prefill, so they equal `teacher_ids` scoring of
                that answer.

        Raises:
            ValueError: a bad argument (an option, a document, token ids outside the vocabulary, a prompt over the
                context window), before any work.
        """
        return self.stream(question, docs, options, question_ids=question_ids, **kwargs).wait()

    def stream(self, question: str | None = None, docs: Iterable[Any] = (),
               options: GenerationOptions | None = None, *, question_ids: Sequence[int] | None = None,
               **kwargs: Any) -> GenerationStream:
        """Like `generate` (same arguments), yielding text deltas; the GenerationResult is `.result` once exhausted.

        Arguments are validated here, before the first delta is asked for. The first `next()` submits the request
        to the scheduler, which decodes it together with the other running requests and queues its deltas for the
        reader (from any thread): a slow or vanished reader never holds the engine. `close()` (or dropping the
        stream) cancels the request at the next decode step (finish_reason "cancelled"). Errors, including a
        prompt over the context window and EngineOverloaded (the queue is full), are raised by `next()`. See
        GenerationStream.
        """
        opts = self._options(options, kwargs)
        docs = self._documents(docs, opts[0])
        question = self._question(question, question_ids)
        return GenerationStream(Request(self, question, docs, None, *opts), self.scheduler.submit)

    def chat(self, messages: Iterable[Any], documents: Iterable[Any] = (),
             options: GenerationOptions | None = None, **kwargs: Any) -> GenerationResult:
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
            documents: documents to look for besides the registered ones (also registered from now on); as text
                (they are found by content).
            options, **kwargs: as `generate`, except `teacher_ids` (not supported for a chat).
        """
        return self.stream_chat(messages, documents, options, **kwargs).wait()

    def stream_chat(self, messages: Iterable[Any], documents: Iterable[Any] = (),
                    options: GenerationOptions | None = None, **kwargs: Any) -> GenerationStream:
        """`chat` as a stream of text deltas (see `stream`)."""
        opts = self._options(options, kwargs, chat=True)
        msgs = _check_messages(messages)
        docs = as_documents(documents)
        by_ids = next((d.id for d in docs if d.token_ids is not None), None)
        if by_ids is not None:
            raise ValueError(f"chat documents are found inside the messages by their text; document {by_ids!r} is "
                             f"given as token ids")
        return GenerationStream(Request(self, "", docs, msgs, *opts), self.scheduler.submit)

    # -- asyncio fronts (what servers and the framework adapters' async paths use) ---------------------------
    async def agenerate(self, *args: Any, **kwargs: Any) -> GenerationResult:
        """`generate` without blocking the event loop (same arguments)."""
        stream = self.astream(*args, **kwargs)
        async for _ in stream:
            pass
        return stream.result

    def astream(self, *args: Any, **kwargs: Any) -> AsyncGenerationStream:
        """`stream` as an async iterator of text deltas (same arguments; validated here)."""
        return AsyncGenerationStream(self.stream(*args, **kwargs).detach(), self.scheduler.submit)

    async def achat(self, *args: Any, **kwargs: Any) -> GenerationResult:
        """`chat` without blocking the event loop (same arguments)."""
        stream = self.astream_chat(*args, **kwargs)
        async for _ in stream:
            pass
        return stream.result

    def astream_chat(self, *args: Any, **kwargs: Any) -> AsyncGenerationStream:
        """`stream_chat` as an async iterator of text deltas (same arguments; validated here)."""
        return AsyncGenerationStream(self.stream_chat(*args, **kwargs).detach(), self.scheduler.submit)

    def register(self, docs: Iterable[Any]) -> int:
        """Remembers documents so that chat prompts containing their bodies are fused (no computation; `precompute`
        registers too). Returns how many can be searched for (bodies of at least 24 characters)."""
        return sum(self.doc_cache.register(d) for d in as_documents(docs))

    def forget(self, doc_ids: Iterable[str]) -> int:
        """Evicts documents by id: their caches in memory and on disk, their id rows and their registration.
        Returns how many ids were known. Entries in use by a running request are left to it and dropped after."""
        ids = [check_text(i, "a document id") for i in ([doc_ids] if isinstance(doc_ids, str) else doc_ids)]
        with self.scheduler.exclusive():
            gone = set(ids)  # a cold document's deferred cache is not built after it was forgotten
            for key in [k for k, (d, *_) in self._cache_backlog.items() if d.id in gone]:
                del self._cache_backlog[key]
            return self.doc_cache.forget(ids)

    def _options(self, options: GenerationOptions | None, kwargs: dict[str, Any], *, chat: bool = False) -> tuple:
        """A request's options (`options` overridden by the keywords), checked against this engine; returns
        (strategy, ratio, max_new, sampler, stop, teacher, return_logprobs, auto, guard, guard_tokens, guard_at)
        (see Request)."""
        if options is None:
            options = GenerationOptions.from_kwargs(**kwargs)
        elif isinstance(options, GenerationOptions):
            options = options._with_kwargs(kwargs)
        else:
            raise ValueError(f"options must be a GenerationOptions, got {type(options).__name__}")
        if chat and options.teacher_ids is not None:
            raise ValueError("teacher_ids is not supported for a chat (score with generate or next_token_logprobs)")
        strat = options.make_strategy()  # a fresh instance per request (a name), or the one given; None: auto
        auto = None
        if strat is None:
            self._check_front()
            auto = (options.target_fidelity, options.ttft_budget_s)
            if options.ttft_budget_s is not None and self.ttft_rate.value is None:
                self.calibrate_ttft()  # before the request is queued (the scheduler thread runs it)
        room = self.context_window - len(self.prompts.prefix_ids) - 1  # beside the prefix and >= 1 question token
        max_new_tokens = check_int(options.max_new_tokens, "max_new_tokens", minimum=1, maximum=room)
        sampler = Sampler(options.temperature, options.top_p, options.seed)
        teacher = None if options.teacher_ids is None else torch.as_tensor(check_token_ids(
            options.teacher_ids, "teacher_ids", self.decoder.spec.vocab, max_len=room), dtype=torch.long)
        guard = self.config.guard_margin if options.guard_margin is None else options.guard_margin
        guard_at = options.guard_at or self.config.guard_at
        guard_tokens = self.config.guard_tokens if options.guard_tokens is None else options.guard_tokens
        if guard_at == "probe":
            guard_tokens = None  # the probe guard reads no answer token
            if guard and strat is not None and strat.name != "full" and not strat.probe_layers(
                    self.decoder.spec.n_layers):
                raise ValueError(f"guard_at='probe' reads the question probe of a query-aware strategy (infoflow, "
                                 f"prophetkv, qcfuse, coinrag); {strat.name!r} runs none (use guard_at='answer')")
        return (strat, options.recompute_ratio, max_new_tokens, sampler, list(options.stop), teacher,
                options.return_logprobs, auto, guard or None, guard_tokens, guard_at)

    # -- strategy="auto" (engine/auto.py) ---------------------------------------------------------------------
    def _check_front(self) -> Front:
        """The front `strategy="auto"` reads; a clear ValueError when this engine has none that describes it."""
        front = self.front
        mine = self.adapter.digest[:16] if self.adapter is not None else ""
        if front is None:
            raise ValueError(f"strategy 'auto' needs a measured front for {self.model_name!r} with this engine's "
                             f"adapter ({mine or 'none'}); build one from a kvfuse eval run (kvfuse front "
                             f"--quality runs/x/summary.csv ...) and set engine.front = Front.load(path)")
        if front.adapter != mine:
            raise ValueError(f"the front of {front.model!r} was measured with adapter {front.adapter or 'none'}, "
                             f"this engine runs {mine or 'none'}: its figures do not describe this engine")
        if not front.usable(self.device.type)[1:]:
            raise ValueError(f"the front of {front.model!r} has no relative TTFT for {self.device.type!r} devices")
        return front

    def choose_auto(self, prompt_tokens: int, target_fidelity: float | None = None,
                    ttft_budget_s: float | None = None) -> Choice:
        """What `strategy="auto"` picks for a prompt of `prompt_tokens` tokens (see engine/auto.py)."""
        front = self._check_front()
        return front.choose(self.device.type, target_fidelity=target_fidelity, ttft_budget_s=ttft_budget_s,
                            full_ttft_s=self.ttft_rate.predict_full(prompt_tokens))

    def observe_ttft(self, strategy: str, ratio: float, prefill_s: float, prompt_tokens: int) -> None:
        """Feeds one served prefill to the full-prefill rate `auto` predicts TTFT with (ignored when the
        (strategy, ratio) point is not on the front)."""
        if self.front is None:
            return
        self.ttft_rate.observe(prefill_s, prompt_tokens, self._front_rel(strategy, ratio))

    def _front_rel(self, strategy: str, ratio: float) -> float | None:
        """The measured TTFT / full's TTFT of (strategy, ratio) on this device from the model's front; None when
        there is no front or no such point. `ratio` as a result reports it (1 for full, 0 for reuse)."""
        if self.front is None:
            return None
        key = (strategy, round(float(ratio), 4), 0.0, 0)  # a served request's own path: the unguarded point
        point = next((p for p in self.front.points if p.key == key), None)
        return None if point is None else point.rel(self.device.type)

    def calibrate_ttft(self, tokens: int = 256) -> float:
        """Times a short full prefill of `tokens` synthetic tokens (twice; the second counts) and seeds the rate
        `auto` predicts TTFT with. Returns the measured seconds per token."""
        n = max(16, min(int(tokens), self.context_window // 2))
        ids = torch.arange(n, dtype=torch.long) % max(1, self.decoder.spec.vocab - 1) + 1
        full = make_strategy("full")
        with self.scheduler.exclusive(), _on_device(self.device):
            ids = ids.to(self.device)
            for _ in range(2):
                t0 = time.perf_counter()
                self.runner.prefill(ids, [Segment(0, n, None, selectable=False)], full, 1.0)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                seconds = time.perf_counter() - t0
        self.ttft_rate.observe(seconds, n, 1.0)
        return seconds / n

    def warmup(self, contexts: tuple[int, int] = (1024, 8192), strategies: Iterable[str | Strategy] | None = None,
               question_tokens: tuple[int, int] = (16, 128), ratios: Iterable[float] = (0.15,),
               doc_tokens: int = 256) -> dict[str, float]:
        """Captures, ahead of traffic, the CUDA graphs of the shape buckets requests in a range will meet, so that
        even the first request of a never-seen layout replays one (as serving engines capture theirs at start-up).

        Requests in the range are synthesised (random token-id documents of `doc_tokens` tokens and a last one of
        the rest, a prompt tail of each bucket's length, one answer token), run through `generate` and their
        documents forgotten afterwards (the results are not kept: a graph replays the same kernels the eager
        padded prefill runs, so tokens do not depend on what was warmed); while it runs a bucket is captured the
        first time it is seen. One request per bucket, found by the bucketed path's own arithmetic. Nothing is done
        without CUDA graphs (CPU, `cuda_graphs=False`).

        Args:
            contexts: (shortest, longest) prompt tokens to cover.
            strategies: the strategies to warm (names or instances); the default strategy when None.
            question_tokens: (shortest, longest) prompt-tail tokens to cover (the question inside its template:
                the rows a fused prefill always computes).
            ratios: recompute ratios to cover (the recomputed-row bucket follows the ratio).
            doc_tokens: tokens of each synthetic document but the last.
        Returns:
            {"requests", "captured", "graphs", "seconds"}.
        """
        lo, hi = (check_int(x, "contexts", minimum=64) for x in contexts)
        q_lo, q_hi = (check_int(x, "question_tokens", minimum=1) for x in question_tokens)
        if lo > hi or q_lo > q_hi:
            raise ValueError("warmup ranges must be (shortest, longest)")
        if hi > self.context_window - 8:
            raise ValueError(f"warmup: contexts up to {hi} tokens exceed the context window ({self.context_window})")
        ratios = [check_real(r, "ratios", low=0.0, high=1.0) for r in ratios]
        strats = [GenerationOptions(strategy=s).strategy for s in (strategies or [GenerationOptions().strategy])]
        strats = [make_strategy(s) if isinstance(s, str) else s for s in strats]
        layouts = self._graph_layouts()
        t0 = time.perf_counter()
        if not layouts:
            return {"requests": 0, "captured": 0, "graphs": 0, "seconds": 0.0}
        before = sum(lg.captures for lg in layouts)
        prefix = len(self.prompts.prefix_ids)
        plan = self._warmup_plan(strats, ratios, lo, hi, q_lo, q_hi, prefix)  # checked before any work
        g = torch.Generator().manual_seed(0)
        made: list[str] = []
        count = 0
        saved = [(lg.capture_after, lg.defer) for lg in layouts]
        for lg in layouts:  # every bucket captured at its first sight, on the warm-up request's path
            lg.capture_after, lg.defer = 1, False
        try:
            for strat, ratio, points in plan:
                for n, q in points:
                    ids, docs = self._warmup_request(n, q, doc_tokens, g, len(made))
                    made += [d.id for d in docs]
                    self.precompute(docs)  # cached, as a served request's documents are: fused whatever the policy
                    self.generate(question_ids=ids, docs=docs, strategy=strat, recompute_ratio=ratio,
                                  max_new_tokens=1)
                    count += 1
        finally:
            for lg, (after, defer) in zip(layouts, saved):
                lg.capture_after, lg.defer = after, defer
            self.forget(made)
        return {"requests": count, "captured": sum(lg.captures for lg in layouts) - before,
                "graphs": sum(len(lg.entries) for lg in layouts), "seconds": time.perf_counter() - t0}

    def _warmup_request(self, n: int, q: int, doc_tokens: int, g: torch.Generator,
                        first: int = 0) -> tuple[list[int], list[Document]]:
        """A synthetic request of n prompt tokens and a q-token tail: (tail ids, documents): a 16-token first
        document (exact), then documents of `doc_tokens` and one of the rest, random token ids, ids from
        `kvfuse-warmup-{first}` on."""
        vocab = self.decoder.spec.vocab
        body = n - len(self.prompts.prefix_ids) - q
        sizes = [16] + [doc_tokens] * ((body - 16) // doc_tokens)
        if body - sum(sizes) > 0:
            sizes.append(body - sum(sizes))
        docs = [Document(f"kvfuse-warmup-{first + i}", token_ids=torch.randint(1, vocab - 1, (s,), generator=g).tolist())
                for i, s in enumerate(sizes)]
        return torch.randint(1, vocab - 1, (q,), generator=g).tolist(), docs

    def _graph_layouts(self) -> list:
        """The bucketed-prefill graph caches of the runners (one per runner that captures graphs)."""
        found = {id(r.layout): r.layout for r in (self.runner, self.fused_runner)
                 if r.layout is not None and r.layout.graphs}
        return list(found.values())

    def _warmup_plan(self, strats: list[Strategy], ratios: list[float], lo: int, hi: int, q_lo: int, q_hi: int,
                     prefix: int) -> list[tuple[Strategy, float, list[tuple[int, int]]]]:
        """[(strategy, ratio, its (prompt, tail) points)] of a warm-up; ValueError when the buckets would not all
        stay captured (more graphs or graph-output bytes than a runner keeps: the first ones would be dropped by
        the last ones)."""
        from .fusion.base import signature

        plan = []
        load: dict[int, tuple[int, int]] = {}  # per bucketed runner: (graphs, bytes) planned
        planned: set = set()  # graph keys (a bucket is one graph whatever the ratio that met it)
        for strat in strats:
            layout = self.prefill_runner(strat).layout
            sig = (signature(strat), id(layout))
            reads_ratio = strat.uses_cache and not getattr(strat, "ignores_ratio", False)
            for ratio in (ratios if reads_ratio else ratios[:1]):
                kind, buckets = self._warmup_buckets(strat, ratio, lo, hi, q_lo, q_hi, prefix)
                new = {b: p for b, p in buckets.items() if (sig, b) not in planned}
                planned.update((sig, b) for b in new)
                plan.append((strat, ratio, list(new.values())))
                if layout is None or not layout.graphs or not new:
                    continue
                graphs, nbytes = load.get(id(layout), (0, 0))
                graphs += len(new)
                nbytes += sum(layout.entry_bytes(kind, *b) for b in new)
                load[id(layout)] = (graphs, nbytes)
                if graphs > layout.max_graphs or nbytes > layout.max_bytes:
                    raise ValueError(
                        f"warmup: these ranges meet {graphs} shape buckets holding {nbytes / 2**30:.2f} GiB of graph "
                        f"outputs, more than the engine keeps ({layout.max_graphs} graphs, "
                        f"{layout.max_bytes / 2**30:.2f} GiB), so the last would drop the first; narrow the context "
                        f"or question range, or warm fewer strategies or ratios")
        return plan

    def _warmup_buckets(self, strat: Strategy, ratio: float, lo: int, hi: int, q_lo: int, q_hi: int,
                        prefix: int) -> tuple[str | None, dict]:
        """(the strategy's bucketed kind, {bucket sizes: (prompt tokens, tail tokens)}): one request per shape bucket
        the range meets under `strat` at `ratio`, by the bucketed path's own arithmetic (`engine/bucketed.py`)."""
        from .bucketed import plan_buckets, strategy_kind
        from .fusion.base import budget_for

        kind = strategy_kind(strat, self.decoder.spec.n_layers)
        if kind is None:
            return None, {}
        fixed = kind == "plain" or strat.ignores_ratio
        # the selection's budget (SelectContext.budget_at): a share of every document row, at most the candidates
        # (the synthetic first document, 16 rows, is exact)
        def k_of(body: int) -> int:
            return 0 if fixed else min(body - 16, budget_for(ratio, body))

        return kind, plan_buckets(kind, lo, hi, q_lo, q_hi, prefix, k_of, self.runner.layout.row_steps)

    def _question(self, question: Any, question_ids: Any) -> str | list[int]:
        """The request's question: its text, or the prompt tail's token ids (checked against the vocabulary)."""
        if question_ids is None:
            if question is None:
                raise ValueError("give a question (text) or question_ids (token ids)")
            return check_text(question, "the question")
        if question is not None:
            raise ValueError("give the question as text or as question_ids, not both")
        return check_token_ids(question_ids, "question_ids", self.decoder.spec.vocab, allow_empty=False)

    def _documents(self, docs: Iterable[Any], strat: Strategy | None = None) -> list[Document]:
        """`as_documents`, and the token ids of documents given as ids checked against the vocabulary (and against
        a strategy whose cache variant reads documents' text)."""
        docs = as_documents(docs)
        vocab = self.decoder.spec.vocab
        for d in docs:
            if d.token_ids is None:
                continue
            if max(d.token_ids) >= vocab:
                check_token_ids(d.token_ids, f"document {d.id!r}: token_ids", vocab)  # raises, naming the index
            if getattr(strat, "cache_variant", None):
                raise ValueError(f"strategy {strat.name!r} finds each document's neighbours by its text; document "
                                 f"{d.id!r} is given as token ids")
        return docs

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
        docs = self._documents(docs, strat)
        check_text(question, "the question")
        t = int(target.numel())
        with self.scheduler.exclusive(), self.store.hold(), _on_device(self.device):
            doc_ids = self._encode_documents(docs)
            layout, segs, _ = self._prepare(question, docs, strat, doc_ids, reserve=t)
            layout, segs, _, run, _ = self._reorder(question, docs, strat, recompute_ratio, layout, segs, doc_ids,
                                                    reserve=t)
            slab = self.decoding.arena.alloc(layout.n + t)
            if slab is None:
                raise RuntimeError("the KV arena can't hold this prompt and target now")
            out = self.prefill_runner(run).prefill(layout.ids, segs, run, recompute_ratio, extra_capacity=t)
            rows = [out.logits[None].clone()]
            seq = self.decoding.open(out.pending, slab, t)
            try:
                if t > 1:
                    rows.append(self.decoding.extend(seq, target[:-1]))
            finally:
                self.decoding.close(seq)
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
        docs = [dataclasses.replace(d, title="") for d in self._documents(docs)]  # bodies only: the rows compared
        if not docs:
            raise ValueError("context_kv needs at least one document")
        full, reuse = make_strategy("full"), Reuse()
        with self.scheduler.exclusive(), self.store.hold(), _on_device(self.device):
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
        disk_degraded (1 while the disk tier is paused after a failure), id_index_bytes, and for the shared Redis
        tier (`redis_url`): redis_hits, redis_errors (failed or timed-out operations, served locally or
        recomputed instead), redis_degraded (1 while it is paused after a failure). corrupt counts both tiers."""
        return self.doc_cache.stats()

    def layout(self, question: str | None = None, docs: Iterable[Any] = (), *,
               question_ids: Sequence[int] | None = None, strategy: str | Strategy = "full") -> PromptLayout:
        """The token layout a request of `strategy` would use (no computation); arguments as `generate`. A fused
        strategy's carries the engine's link rows after every document, when it has some."""
        docs = self._documents(docs)
        question = self._question(question, question_ids)
        return self.prompts.build(question, [self.prompts.encode_document(d) for d in docs],
                                  [self.prompts.encode_title(d) for d in docs], self._links_for(make_strategy(strategy)))

    def _links_for(self, strat: Strategy) -> list[int] | None:
        """The link rows' placeholder ids a request of `strat` is laid out with (engine/links.py), or None."""
        return self._link_ids if self._link_ids is not None and applies_to(strat) else None

    def serving_stats(self) -> dict[str, int]:
        """Scheduler gauges for a server's metrics: `running` (requests decoding), `queued` (waiting for a slot),
        `batch_size` (requests in the last decode step), `pool_rows_used` / `pool_rows_total` (KV rows of the GPU
        pool or decode arena), `requests_done`; with CUDA graphs also `prefill_graph_replays`,
        `prefill_graph_captures` and `prefill_eager_runs` (bucketed prefills by how they ran) and
        `prefill_graphs_deferred` (buckets waiting for idle time to be captured)."""
        pool = self.decoding.arena.pool
        stats = self.scheduler.stats()
        stats.update(pool_rows_used=pool.doc_rows - pool.free_rows, pool_rows_total=pool.doc_rows)
        layouts = self._graph_layouts()
        if layouts:  # prefills of the bucketed path by how they ran: a graph replayed, captured, or eager
            stats.update(prefill_graph_replays=sum(g.replays for g in layouts),
                         prefill_graph_captures=sum(g.captures for g in layouts),
                         prefill_eager_runs=sum(g.eager_runs for g in layouts),
                         prefill_graphs_deferred=sum(len(g.backlog) for g in layouts))
        return stats

    def shutdown(self, timeout: float | None = None) -> None:
        """Stops taking requests; waits up to `timeout` seconds (None: until done) for queued and running requests
        to finish, then cancels the rest (finish_reason "cancelled"). Later requests raise RuntimeError."""
        self.scheduler.shutdown(timeout)

    def close(self) -> None:
        """Shuts the scheduler down (cancelling what is still running) and closes the caches."""
        self.scheduler.shutdown(timeout=0)
        self.doc_cache.close()

    # -- internals -------------------------------------------------------------------------------------
    def _make_arena(self) -> Arena:
        """Decode rows: the document pool itself (documents read in place), or a pool of their own (host tier)."""
        pool = self.store.memory.pool
        if pool is not None:
            return Arena(pool, self.store.memory._evict_lru)
        spec = self.decoder.spec
        _, rows = sized_rows(self.config, self.context_window, 0, 1,
                             spec.kv_bytes_per_token * self.decoder.embed.element_size(), self.device)
        return Arena(KVPool(spec.n_layers, spec.n_kv_heads, spec.head_dim, rows, 1, self.dtype, self.device))

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

    def prefill_runner(self, strat: Strategy) -> Runner:
        """The Runner a prefill of `strat` runs on: `fused_runner` for strategies that read caches (the online
        adapter's merged weights, when one is set), the base model's otherwise."""
        return self.fused_runner if strat.uses_cache else self.runner

    def _prepare(self, question: str | list[int], docs: list[Document], strat: Strategy,
                 doc_ids: list[list[int]] | None = None, reserve: int = 0):
        """Lays out the prompt, checks that it and `reserve` answer tokens fit the context window (before any
        lookup or model work), looks up (computing misses) and returns (layout, segments, seconds spent on misses).

        `question`: its text, or the prompt tail's token ids (`PromptBuilder.build`).

        `doc_ids`: the documents' token ids when already encoded (`_encode_documents`); tokenized here otherwise.
        """
        if doc_ids is None:
            doc_ids = self._encode_documents(docs)
        layout = self.prompts.build(question, doc_ids, [self.prompts.encode_title(d) for d in docs],
                                    self._links_for(strat))
        return self._lay_out(layout, docs, doc_ids, strat, reserve)

    def _lay_out(self, layout: PromptLayout, docs: list[Document], doc_ids: list[list[int]], strat: Strategy,
                 reserve: int, keep: list[int | None] | None = None):
        """Checks the layout against the window, then serves its documents (computing misses) and returns
        (layout, segments in prompt order, seconds spent on misses). Prefix: cached when it is the engine's fixed
        prefix; documents: cached (selectable); glue and tail: computed. `keep[i]`: serve only the first rows of
        document i's cache (a body found without the suffix it was cached with)."""
        t0 = time.perf_counter()
        self._check_fits(layout, docs, reserve)
        if strat.uses_cache:
            self.doc_cache.pool.add(docs)  # the pool `pick="pool"` draws context from (frozen once full)
        if hasattr(strat, "use_model_profile"):  # e.g. qcfuse's critical layers, found offline per model
            strat.use_model_profile(load_profile(self))
        miss_tokens, kvs = 0, [None] * len(docs)
        # the first document right after the cached prefix it was computed after: its plain cache IS what full
        # prefill computes there (documents computed with the fusion adapter offline differ by design: not exact).
        # A strategy with a cache variant (fusionrag) gets that plain cache for it too, the variant for the others.
        exact = strat.uses_cache and layout.first_document_exact(self._documents_adapted)
        if strat.uses_cache:
            if exact and getattr(strat, "cache_variant", None):
                pairs, miss_tokens = self.doc_cache.kvs(docs[:1], None, doc_ids[:1])
                rest, more = self.doc_cache.kvs(docs[1:], strat, doc_ids[1:])
                pairs, miss_tokens = pairs + rest, miss_tokens + more
            else:
                pairs, miss_tokens = self.doc_cache.kvs(docs, strat, doc_ids)
            kvs = [kv if not n else _head(kv, n) for (_, kv), n in zip(pairs, keep or [None] * len(pairs))]
        prefix_kv = self.doc_cache.prefix_kv() if strat.uses_cache and layout.prefix_cached else None
        miss_s = time.perf_counter() - t0 if miss_tokens else 0.0
        return layout, _segments(layout, prefix_kv, kvs, exact, self.prompts.question_span(layout)), miss_s

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
        links = self._links_for(strat)
        pieces: list[tuple[str, list[int]]] = []
        for i, chunk in enumerate(_DOC_SPLIT.split(text)):
            if i % 2 == 0:
                pieces.append(("text", self.prompts.encode_text(chunk)))
            else:
                ids, keep, rest = doc_ids[int(chunk)]
                pieces.append(("doc", ids[:keep] if keep is not None else ids))
                if rest:
                    pieces.append(("text", rest))
                if links:
                    pieces.append(("text", list(links)))
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
        """What a request's prefill runs on, once its prompt is laid out: for a strategy with `reorders_documents`
        (infoflow's reorder) one selection pass over the given order, then the prompt again in the order
        `strat.document_order` asks for; for one with `compresses_documents` (coinrag) the prompt cut to its
        nuggets; for one with `sparse_index` (sift) the request's sparse plan.

        Returns (layout, segs, seconds, run, report): `run` is the strategy to prefill with (sift: a copy bound to
        this request's plan, or the engine's `dense_strategy` when the request attends densely; else `strat`),
        `report` what the request's result reports under the strategy's name (sift's indexes and density), or
        None. `strat` itself is never changed: requests may share the instance a caller passed."""
        if getattr(strat, "compresses_documents", False):
            return (*self._compress(question, docs, strat, ratio, layout, segs, reserve), strat, None)
        if getattr(strat, "sparse_index", False):
            t0 = time.perf_counter()
            plan, report = self._sift_plan(layout, strat, docs)
            run = self.dense_strategy if plan is None else strat.bound(plan)  # dense: full's (graphed) path
            return layout, segs, time.perf_counter() - t0, run, report
        if not getattr(strat, "reorders_documents", False) or len(docs) < 2:
            return layout, segs, 0.0, strat, None
        t0 = time.perf_counter()
        if doc_ids is None:
            doc_ids = [d.tolist() for d in layout.doc_ids]
        every = [dataclasses.replace(sg, exact=False) for sg in segs]  # the first document is ordered like the others
        order = reorder_documents(self.prefill_runner(strat), layout, every, list(range(len(docs))), strat, ratio)
        layout, segs, _ = self._prepare(question, [docs[i] for i in order], strat, [doc_ids[i] for i in order],
                                        reserve)
        return layout, segs, time.perf_counter() - t0, strat, None


    def _compress(self, question, docs: list[Document], strat: Strategy, ratio: float, layout, segs, reserve: int):
        """For a strategy with `compresses_documents` (coinrag): one question probe over the whole documents, then
        the prompt again with only the rows `strat.nuggets` keeps of each (their cache rows sliced, re-positioned
        at their new positions; a document with none kept leaves with its title). Returns (layout, segs, s)."""
        t0 = time.perf_counter()
        every = [dataclasses.replace(sg, exact=False) for sg in segs]
        ctx, _ = select_only(self.prefill_runner(strat), layout.ids, every, strat, ratio)
        if ctx is None or len(ctx.doc_spans) != len(layout.docs):  # a document without a cache: nothing to cut
            return layout, segs, 0.0
        by_start = {sg.start: sg.kv for sg in every if sg.kv is not None}
        sentences = [sentence_spans(self._token_texts(ids.tolist()), strat.min_sentence_tokens)
                     for ids in layout.doc_ids]
        rows = strat.nuggets(ctx, sentences)
        kept = [i for i, r in enumerate(rows) if r.numel()]
        new = self.prompts.build(question, [layout.doc_ids[i][rows[i]].tolist() for i in kept],
                                 [self.prompts.encode_title(docs[i]) for i in kept])
        self._check_fits(new, [docs[i] for i in kept], reserve)
        kvs = [_rows(by_start[layout.docs[i].start], rows[i]) for i in kept]
        return new, _segments(new, every[0].kv, kvs, False, self.prompts.question_span(new)), time.perf_counter() - t0

    def _sift_index(self, ids: list[int], strat, key: str | None = None, compute: bool = True) -> tuple[Any, bool]:
        """A document's selective index (engine/sift.py) from the index store, computed on a miss (None instead when
        not `compute`); (index, hit)."""
        key = key or self._sift_key(ids, strat)
        idx = self.sift_indexes.get(key)
        if idx is not None:
            return idx, True
        if not compute:
            return None, False
        idx = compute_index(self, ids, strat.block, strat.local_mass, strat.cross_mass)
        self.sift_indexes.put(key, idx)
        return idx, False

    def _sift_key(self, ids: list[int], strat) -> str:
        """An index's key: the cache key of the document after the prefix, bound to the index parameters."""
        import hashlib

        base = content_key(self.namespace, self.prompts.prefix_ids, ids)
        return hashlib.sha256(f"{base}|{strat.index_params()}".encode()).hexdigest()

    def _sift_plan(self, layout, strat, docs: list[Document] | None = None):
        """The block lists of a sift request, and its report (indexes hit / computed / carried / rejected, density).

        A document that carries its index (`Document.sift_index`, from node metadata) is served by it when it is
        intact and made for exactly this model, tokenizer, prompt layout, index settings and text; a carried index
        that is not (damaged, truncated, another model's or another text's) is counted as rejected and that
        document attends densely: never a failure, never a stale index."""
        block = strat.kernel_block or (64 if self.device.type == "cuda" else 16)
        min_tokens = 4 * self.decoder.spec.hidden if strat.min_tokens is None else strat.min_tokens
        report = {"index_hits": 0, "index_computed": 0, "index_carried": 0, "index_rejected": 0,
                  "index_deferred": 0, "density": 1.0, "kernel_block": block, "sparse": False}
        if layout.n < min_tokens:  # too short for the sparse kernel to pay: dense, no index looked up
            return None, {**report, "dense_reason": f"prompt of {layout.n} tokens < min_tokens {min_tokens}"}
        carried = ([d.sift_index for d in docs] if docs is not None and len(docs) == len(layout.docs)
                   else [None] * len(layout.docs))
        n_layers = self.decoder.spec.n_layers
        plan, hits, computed, used, rejected, deferred = [], 0, 0, 0, 0, 0
        with _on_device(self.device):
            all_ids = [ids.tolist() for ids in layout.doc_ids]
            keys = [self._sift_key(ids_l, strat) for ids_l in all_ids]
            built = {}
            if strat.on_miss == "compute":  # the request's missing indexes (not carried) in one pass
                todo = [(i, k) for i, k, data in zip(all_ids, keys, carried, strict=True) if data is None]
                built = self._build_indexes([i for i, _ in todo], [k for _, k in todo], strat)
            for sp, ids_l, key, data in zip(layout.docs, all_ids, keys, carried, strict=True):
                if data is not None:  # checked once per (key, bytes), then served from a memo
                    idx = self.sift_indexes.carried(key, data, n_layers, len(ids_l))
                    used += idx is not None
                    rejected += idx is None
                elif key in built:  # computed above for this request
                    idx = built.pop(key)
                    computed += 1
                else:
                    idx, hit = self._sift_index(ids_l, strat, key, compute=strat.on_miss == "compute")
                    hits += hit
                    computed += idx is not None and not hit
                    if idx is None:  # on_miss="dense": attends densely now, its index is built when idle
                        deferred += 1
                        self._index_backlog.setdefault(key, (ids_l, strat.block, strat.local_mass, strat.cross_mass))
                        while len(self._index_backlog) > MAX_INDEX_BACKLOG:  # never idle: the oldest wait longest
                            self._index_backlog.popitem(last=False)
                plan.append((sp.start, sp.end, idx))
            lists, counts, density = sparse_plan(layout.n, n_layers, plan, block, self.device, window=strat.window,
                                                  cross=strat.cross, local=strat.local, heads=strat.heads,
                                                  max_density=strat.max_density)
        report.update(index_hits=hits, index_computed=computed, index_carried=used, index_rejected=rejected,
                      index_deferred=deferred, density=round(density, 4))
        if lists is None:  # denser than max_density: the sparse kernel would be slower than dense attention
            return None, {**report, "density": 1.0, "plan_density": round(density, 4),
                          "dense_reason": f"plan density {density:.3f} > max_density {strat.max_density}"}
        return (lists, counts, block), {**report, "sparse": True}

    def cold_documents(self, docs: list[Document], doc_ids: list[list[int]], strat: Strategy, ratio: float,
                       tail_tokens: int) -> dict | None:
        """Whether a request is answered by full prefill because of its documents with no cache yet
        (`EngineConfig.cold_documents`): None to serve it as asked (missing caches computed first, as before), else
        what the result reports in `extra["cold"]`; the missing documents then wait in the backlog the scheduler
        builds from between requests. A document already waiting there (seen cold before, not built yet) is
        computed by this request instead, so a document in steady demand gets its cache even when the engine is
        never idle. Strategies that read no cache, or a cache variant of their own (fusionrag), are served as asked."""
        policy = self.config.cold_documents
        if (policy == "compute" or not strat.uses_cache or getattr(strat, "cache_variant", None)
                or getattr(strat, "sparse_index", False)):
            return None
        missing = []
        for d, ids in zip(docs, doc_ids):
            key = content_key(self.namespace, self.prompts.prefix_ids, ids)
            if key in self._cache_backlog:  # its second sight: computed now
                return None
            if not self.store.peek(key):
                missing.append((key, d, ids))
        if not missing:
            return None
        miss_tokens = sum(len(ids) for *_, ids in missing)
        n = len(self.prompts.prefix_ids) + sum(len(ids) for ids in doc_ids) + tail_tokens
        rel = self._front_rel(strat.name, ratio)
        rel = DEFAULT_FUSED_REL if rel is None else rel
        if policy == "auto" and miss_tokens / max(1, n) < 1.0 - rel:
            return None
        for key, d, ids in missing:
            self._cache_backlog.setdefault(key, (d, list(ids), strat.name))
        while len(self._cache_backlog) > MAX_INDEX_BACKLOG:  # never idle: the oldest wait longest
            self._cache_backlog.popitem(last=False)
        return {"requested": strat.name, "ratio": float(ratio), "policy": policy, "missing_documents": len(missing),
                "missing_tokens": miss_tokens, "prompt_tokens": n, "fused_rel_ttft": rel}

    def build_deferred(self) -> bool:
        """Builds one cache, graph or index that a request deferred (a cold document's cache, `cold_documents`; a
        shape bucket's CUDA graph, `LayoutGraphs.capture_deferred`; a sift index, `on_miss="dense"`); False when none
        is waiting. The scheduler calls it between requests (never while one is waiting or running)."""
        if self._cache_backlog:
            key, (doc, ids, name) = next(iter(self._cache_backlog.items()))
            try:  # left in the backlog while it is built, so `wait_for_deferred` waits for the store to hold it
                if not self.store.peek(key):
                    with self.doc_cache.hold():
                        self.doc_cache.kvs([doc], make_strategy(name), [ids])
            finally:
                self._cache_backlog.pop(key, None)
            return True
        if any(lg.capture_deferred() for lg in self._graph_layouts()):
            return True
        return self.build_deferred_index()

    @property
    def deferred_work(self) -> int:
        """Caches, graphs and indexes waiting to be built between requests."""
        return (len(self._cache_backlog) + len(self._index_backlog)
                + sum(len(lg.backlog) for lg in self._graph_layouts()))

    def wait_for_deferred(self, timeout: float = 60.0) -> bool:
        """Blocks until every deferred cache, graph and index is built (True) or `timeout` seconds pass (False)."""
        return _wait_until(lambda: not self.deferred_work, timeout)

    def build_deferred_index(self) -> bool:
        """Builds one index that a request deferred (sift's `on_miss="dense"`); False when none is waiting."""
        if not self._index_backlog:
            return False
        key, (ids, block, local_mass, cross_mass) = next(iter(self._index_backlog.items()))
        try:  # left in the backlog while it is built, so `wait_for_indexes` waits for the store to hold it
            if key not in self.sift_indexes:
                self.sift_indexes.put(key, compute_index(self, ids, block, local_mass, cross_mass))
        finally:
            self._index_backlog.pop(key, None)
        return True

    @property
    def deferred_indexes(self) -> int:
        """Indexes waiting to be built between requests."""
        return len(self._index_backlog)

    def wait_for_indexes(self, timeout: float = 60.0) -> bool:
        """Blocks until every deferred index is built (True) or `timeout` seconds pass (False)."""
        return _wait_until(lambda: not self._index_backlog, timeout)

    def sift_index_bytes(self, docs: Iterable[Any], strategy: str | Strategy = "sift") -> list[bytes]:
        """Each document's selective index, serialised (`SiftIndex.to_bytes`, a few KB; computed where missing):
        the bytes that ride with a document (`Document(..., sift_index=...)`, node or Document metadata through
        the integrations), so a request needs no index store. The bytes name the model, tokenizer, prompt layout,
        index settings and the document's tokens; any other use of them is refused at request time.

        Raises:
            ValueError: `strategy` is not an index strategy, or a document does not fit the context window.
        """
        return self.precompute_indexes(docs, strategy)[1]

    def precompute_indexes(self, docs: Iterable[Any], strategy: str | Strategy = "sift"
                           ) -> tuple[PrecomputeReport, list[bytes]]:
        """`precompute(docs, strategy)` and `sift_index_bytes(docs, strategy)` in one pass over the documents: what
        an ingestion pipeline that stores the indexes with its documents calls."""
        strat = make_strategy(strategy)
        if not getattr(strat, "sparse_index", False):
            raise ValueError(f"strategy {strat.name!r} keeps no selective index (use 'sift')")
        return self._precompute_indexes(self._documents(docs, strat), strat, with_bytes=True)

    def _token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (memoised per token id)."""
        memo = self.__dict__.setdefault("_token_text_memo", {})
        out = []
        for t in ids:
            s = memo.get(t)
            if s is None:
                s = memo[t] = self.tokenizer.decode([t])
            out.append(s)
        return out


def _segments(layout: PromptLayout, prefix_kv: DocKV | None, kvs: list, exact_first: bool,
              question: Span | None = None) -> list[Segment]:
    """Runner segments of a layout: the prefix (cached when `prefix_kv`), each document from its cache (the first
    one exact when `exact_first`), glue and the tail computed; the tail's `question` rows (the question's own
    tokens, `PromptBuilder.question_span`) marked as such."""
    segs = [Segment(layout.prefix.start, layout.prefix.end, prefix_kv, selectable=False)]
    segs += [Segment(sp.start, sp.end, kv, exact=exact_first and i == 0) for i, (sp, kv) in
             enumerate(zip(layout.docs, kvs))]
    segs += [Segment(sp.start, sp.end, None, selectable=False) for sp in layout.glue]
    segs.sort(key=lambda sg: sg.start)
    t = layout.tail
    if question is None or not t.start <= question.start < question.end <= t.end:
        segs.append(Segment(t.start, t.end, None, selectable=False))
        return segs
    for s, e, own in ((t.start, question.start, False), (question.start, question.end, True),
                      (question.end, t.end, False)):
        if e > s:
            segs.append(Segment(s, e, None, selectable=False, question=own))
    return segs


def _rows(kv: DocKV, rows: torch.Tensor) -> DocKV:
    """Some rows of a cached document, as a standalone copy (keys stay pre-RoPE: re-positioned where used)."""
    idx = rows.to(kv.k.device)
    return DocKV(kv.k.index_select(1, idx), kv.v.index_select(1, idx))


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


def _check_on_device(hf_model, device: torch.device) -> None:
    """Raises ValueError naming the first parameter or buffer not on the model's compute device (a kernel would
    otherwise read host memory, or another GPU's, through a device pointer)."""
    for name, t in list(hf_model.named_parameters()) + list(hf_model.named_buffers()):
        if t.device.type != device.type or (device.index is not None and t.device.index not in (None, device.index)):
            raise ValueError(f"model tensor {name!r} is on {t.device}, the model computes on {device}: move the "
                             f"whole model to one device (model.to({str(device)!r}))")


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
