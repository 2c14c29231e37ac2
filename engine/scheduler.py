"""The scheduler: many requests at once over one engine (continuous batching).

One thread computes. Each iteration it admits waiting requests (fused prefill and first token each) until the
tokens they computed reach `prefill_tokens_per_step` (at least one request), then runs ONE batched decode step
for every running request: prefills interleave with decode under a per-step token budget, so a burst of arrivals
delays the others' next token by about one budget, and a request joins or leaves the batch between any two
steps. Everything else that needs the model (precompute, forget, teacher-forced scoring) takes the engine between
iterations (`exclusive`).

Admission: at most `max_batch_size` requests decode at once; a request waits (in a queue of at most
`max_queued_requests`; beyond it `submit` raises EngineOverloaded) until a slot and `n + max_new` arena rows are
free. A cancelled request (its stream closed or dropped) leaves the batch at the next step and frees its rows.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

import torch

from .bucketed import ProbeGuardTripped
from .fusion import make_strategy
from .threads import set_own_threads
from .tracing import set_attributes, span
from .types import EngineOverloaded, GenerationResult

__all__ = ["Request", "Scheduler"]

log = logging.getLogger("kvfuse.scheduler")

DELTA, DONE, ERROR = "delta", "done", "error"


class _NoRoom(Exception):
    """The arena can't hold the request's rows until a running request finishes."""


class _Escalate(Exception):
    """The guard: the fused prefill's first token is a near-tie (top-2 margin below the request's guard)."""

    def __init__(self, margin: float) -> None:
        super().__init__(margin)
        self.margin = margin


def _top2(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Per row of [B, vocab] logits: the argmax, and the gap between the two largest logits (= the log-prob gap, in
    nats, computed in fp32); both in one host read."""
    top = logits.float().topk(2, dim=-1)
    idx, gap = torch.stack((top.indices[:, 0].double(), (top.values[:, 0] - top.values[:, 1]).double())).tolist()
    return [int(i) for i in idx], gap


class Request:
    """One generation request as it moves through the scheduler.

    Args:
        engine: the FusionEngine (its prompt building, cache service and runner do the work).
        question / docs / messages: what to answer (a chat when `messages` is given).
        strat, ratio, max_new, sampler, stop, teacher, return_logprobs, auto, guard, guard_tokens: validated
            options.
    Attributes:
        cancel: set by the reader (close, drop) to end the request at the next step.
        sink: `sink((kind, value))` delivers DELTA text, then DONE result or ERROR exception (set by the stream).
    """

    def __init__(self, engine, question: str, docs: list, messages: list | None, strat, ratio: float, max_new: int,
                 sampler, stop: list[str], teacher: torch.Tensor | None, return_logprobs: bool,
                 auto: tuple | None = None, guard: float | None = None, guard_tokens: int | None = None,
                 guard_at: str = "answer") -> None:
        self.engine = engine
        self.question, self.docs, self.messages = question, docs, messages
        self.strat, self.ratio, self.max_new, self.sampler = strat, ratio, max_new, sampler
        self.stop, self.teacher, self.return_logprobs = stop, teacher, return_logprobs
        self.auto = auto  # strategy="auto": (target_fidelity, ttft_budget_s); the strategy is picked at start
        self.guard = guard  # GenerationOptions.guard_margin: below this top-2 margin, full prefill takes over
        self.guard_tokens = guard_tokens  # ... checked on the answer's first this many tokens (None: all)
        self.guard_at = guard_at  # "answer": the fused answer's tokens; "probe": the question probe's first token
        self.cancel = threading.Event()
        self.sink: Callable[[tuple[str, Any]], None] | None = None
        self.t_call = time.perf_counter()
        self.seq = None
        self.pins: set[str] = set()
        self.tokens: list[int] = []
        self.detok = _Detokenizer(engine.tokenizer)
        self.text, self.emitted, self.finish = "", 0, "length"
        self.next_token: int | None = None
        self.extra: dict[str, Any] = {}
        self.link_rows = 0  # link rows the prefill wrote after the documents (not prompt tokens)

    # -- phases (scheduler thread) ------------------------------------------------------------------------------
    def _choose(self) -> list | None:
        """strategy="auto": the front's point for this prompt's size (engine/auto.py). Returns the documents'
        token ids it counted (None for a chat), so the prefill does not encode them again."""
        eng = self.engine
        doc_ids = None
        if self.messages is None:
            doc_ids = eng._encode_documents(self.docs)
            n = len(eng.prompts.prefix_ids) + sum(len(ids) for ids in doc_ids) + self._tail_tokens()
        else:
            n = len(eng.prompts.prefix_ids) + sum(len(eng.tokenizer.encode(m["content"], add_special_tokens=False))
                                                  for m in self.messages)
        choice = eng.choose_auto(n, *self.auto)
        self.strat = make_strategy(choice.strategy)
        self.ratio = choice.ratio
        if choice.guard:  # a guarded point: its guard, as measured, whatever the request or engine default set
            self.guard, self.guard_tokens, self.guard_at = choice.guard, choice.guard_tokens, choice.guard_at
        self.extra["auto"] = choice.as_dict()
        return doc_ids

    def _tail_tokens(self) -> int:
        """Tokens of the question part of the prompt (its template included)."""
        q = self.question
        return len(q) if isinstance(q, list) else len(self.engine.prompts.encode_tail(q))

    def start(self, decoding) -> bool:
        """Prefill and first token. Returns whether the request goes on decoding. Raises _NoRoom to wait."""
        if "guard" not in self.extra:  # (an escalated request keeps its first start: queue_s is the wait)
            self.t_start = time.perf_counter()
        doc_ids = self._choose() if self.auto is not None and self.strat is None else None
        eng = self.engine
        if (self.messages is None and eng.config.cold_documents != "compute"
                and "cold" not in self.extra):  # (a retry after _NoRoom has decided already)
            if doc_ids is None:
                doc_ids = eng._encode_documents(self.docs)
            cold = eng.cold_documents(self.docs, doc_ids, self.strat, self.ratio, self._tail_tokens())
            if cold is not None:  # new documents: full prefill now, their caches built when the engine is idle
                self.strat, self.extra["cold"] = make_strategy("full"), cold
        n_teacher = 0 if self.teacher is None else int(self.teacher.numel())
        self.reserve = max(self.max_new, n_teacher)
        try:
            out = self._prefill(decoding, doc_ids, first=True)
        except _Escalate as esc:  # the guard: the fused first token was a near-tie; full prefill answers
            self._escalated(0, esc.margin)
            return self.start(decoding)
        eng.observe_ttft(self.strat.name, self._reported_ratio(), self.t_first - self.t_prefill,
                         self.layout.n)
        self.first_logits = out.logits.clone() if (n_teacher or self.return_logprobs) else None
        if n_teacher:
            rows = [self.first_logits[None]]
            if n_teacher > 1:
                rows.append(decoding.extend(self.seq, self.teacher[:-1]))
                self.seq.length = self.layout.n  # decoding overwrites the teacher rows
            self.extra["teacher_logprobs"] = torch.log_softmax(torch.cat(rows).float(), dim=-1).cpu()
        return self.accept(self.first_token)

    def _prefill(self, decoding, doc_ids: list | None, first: bool):
        """This request's prefill under `self.strat`, its sequence opened in the arena; returns the
        PrefillOutput. `first`: the request's first token follows (the guard may escalate it: _Escalate)."""
        eng = self.engine
        strat, store, reserve = self.strat, eng.store, self.reserve
        with store.hold(), span("kvfuse.prefill", strategy=strat.name, recompute_ratio=self.ratio,
                                documents=len(self.docs), chat=self.messages is not None) as sp:
            before = store.snapshot()
            if self.messages is None:
                if doc_ids is None:
                    doc_ids = eng._encode_documents(self.docs)
                layout, segs, miss_s = eng._prepare(self.question, self.docs, strat, doc_ids, reserve)
                self.t_prefill = time.perf_counter()
                layout, segs, reorder_s, run, report = eng._reorder(self.question, self.docs, strat, self.ratio,
                                                                    layout, segs, doc_ids, reserve)
            else:  # a chat: documents found by content, no reordering (the user's text stays as written)
                layout, segs, miss_s, found = eng._prepare_chat(self.messages, self.docs, strat, reserve)
                run, report = strat, None
                if getattr(strat, "sparse_index", False):  # no sparse plan for a chat: it is prefilled densely
                    run, report = eng.dense_strategy, {"sparse": False, "dense_reason": "a chat prompt"}
                self.extra["documents"] = [d.id for d in found]
                self.t_prefill, reorder_s = time.perf_counter(), 0.0
            slab = decoding.arena.alloc(layout.n + reserve)
            if slab is None:
                raise _NoRoom
            seq = None
            try:
                try:
                    out = eng.prefill_runner(run).prefill(layout.ids, segs, run, self.ratio,
                                                          extra_capacity=reserve, probe_guard=self._probe_guard(first))
                except ProbeGuardTripped as trip:  # the probe's first token is a near-tie: no fused pass
                    raise _Escalate(trip.margin) from None
                if first:
                    greedy = None
                    if self.guarding:  # the same read gives the greedy token
                        (greedy,), (margin,) = _top2(out.logits[None])
                        if margin < self.guard:
                            raise _Escalate(margin)
                    self.first_token = (greedy if greedy is not None and self.sampler.temperature == 0
                                        else self.sampler(out.logits))
                    self.t_first = time.perf_counter()
                pins = set(store.memory.held)  # the documents the sequence reads in place stay put
                store.memory.pin(pins)
                self.pins |= pins
                seq = self.seq = decoding.open(out.pending, slab, reserve)
            except BaseException:
                if seq is None:
                    decoding.arena.free(slab)
                raise
            # link rows (engine/links.py): computed with the request but not the user's text, so counted apart
            linked = bool(layout.docs) and eng._links_for(run) is not None
            self.link_rows = eng.links.k * len(layout.docs) if linked else 0
            if linked:
                self.extra["links"] = {"rows": eng.links.k, "tokens": self.link_rows,
                                       "digest": eng.links.digest[:16]}
            after = store.snapshot()
            set_attributes(sp, prompt_tokens=layout.n - self.link_rows, doc_tokens=layout.doc_tokens,
                           recomputed_tokens=int(out.recomputed.numel()), cache_hits=after.hits - before.hits,
                           cache_misses=after.misses - before.misses, queue_s=self.t_start - self.t_call)
            if first:
                set_attributes(sp, ttft_s=self.t_first - self.t_call)
        self.layout, self.miss_s, self.stats = layout, miss_s, (before, after)
        self.selection_s = out.selection_s + reorder_s
        if report:  # e.g. sift's indexes and attention density
            self.extra[strat.name] = dict(report)
        self.recomputed = out.recomputed.tolist() if strat.uses_cache else []
        return out

    # -- the guard (GenerationOptions.guard_margin) -----------------------------------------------------------------
    @property
    def guarding(self) -> bool:
        """Whether this request's tokens are checked: a guard is set on the answer and its path is not full prefill
        already."""
        return (self.guard is not None and self.guard_at == "answer" and self.strat is not None
                and self.strat.name != "full" and (self.guard_tokens is None or len(self.tokens) < self.guard_tokens))

    def _probe_guard(self, first: bool) -> float | None:
        """The margin the prefill's question probe checks (GenerationOptions.guard_at="probe"), or None."""
        if (not first or self.guard is None or self.guard_at != "probe" or self.strat is None
                or self.strat.name == "full"):
            return None
        return self.guard

    def _escalated(self, step: int, margin: float) -> None:
        self.extra["guard"] = {"requested": self.strat.name, "ratio": float(self._reported_ratio()),
                               "margin_nats": float(self.guard), "at": self.guard_at, "escalated_at": step,
                               "margin": round(margin, 4),
                               "fused_s": round(time.perf_counter() - self.t_start, 6)}
        self.strat = make_strategy("full")

    def escalate(self, decoding, margin: float):
        """The guard, mid-answer: the answer so far is re-read after a full prefill of the prompt; returns the
        [vocab] logits of the next token under full prefill, or None (no arena room: the fused path goes on)."""
        old_seq, old_pins, old_strat = self.seq, self.pins, self.strat
        step = len(self.tokens)
        self._escalated(step, margin)
        self.pins = set()
        try:
            out = self._prefill(decoding, None, first=False)
        except _NoRoom:
            self.extra["guard"]["skipped"] = "no arena rows for a full prefill beside the running requests"
            self.seq, self.pins, self.strat = old_seq, old_pins, old_strat
            self.guard = None  # not tried again at every step
            return None
        except BaseException:
            self.pins |= old_pins  # the request fails: released with its (old) sequence
            raise
        decoding.close(old_seq)
        if old_pins:
            self.engine.store.memory.unpin(old_pins)
        if self.return_logprobs:  # the answer is re-scored under the path that serves it
            self.first_logits = out.logits.clone()
        return decoding.extend(self.seq, torch.tensor(self.tokens, dtype=torch.long))[-1]

    def _reported_ratio(self) -> float:
        strat = self.strat
        return 1.0 if not strat.uses_cache else (0.0 if strat.ignores_ratio else self.ratio)

    def accept(self, token: int) -> bool:
        """Takes a sampled token: emits the text it completes; returns whether to decode another."""
        eng = self.engine
        if token in eng.eos_ids:
            self.finish = "stop"
            return False
        self.tokens.append(token)
        self.text = self.detok.add(token)
        cut = _first_stop(self.text, self.stop)
        if cut is not None:
            self.text, self.finish = self.text[:cut], "stop"
            return False
        safe = len(self.text) - _held_back(self.text, self.stop)
        if safe > self.emitted:
            self.sink((DELTA, self.text[self.emitted:safe]))
            self.emitted = safe
        if len(self.tokens) >= self.max_new:
            return False
        if self.cancel.is_set():
            self.finish = "cancelled"
            return False
        self.next_token = token
        return True

    def complete(self, decoding) -> None:
        """Final delta, optional re-scoring, rows given back, result delivered."""
        if len(self.text) > self.emitted and self.finish != "cancelled":
            self.sink((DELTA, self.text[self.emitted:]))
        t_end = time.perf_counter()
        if self.return_logprobs and self.finish != "cancelled":  # the answer re-scored in one pass
            rows = [self.first_logits[None]]
            if len(self.tokens) > 1:
                self.seq.length = self.layout.n
                rows.append(decoding.extend(self.seq, torch.tensor(self.tokens[:-1])))
            self.extra["logprobs"] = torch.log_softmax(torch.cat(rows).float(), dim=-1).cpu()
        self.release(decoding)
        strat, layout = self.strat, self.layout
        before, after = self.stats
        self.sink((DONE, GenerationResult(
            text=self.text, token_ids=self.tokens, strategy=strat.name,
            recompute_ratio=1.0 if not strat.uses_cache else (0.0 if strat.ignores_ratio else self.ratio),
            finish_reason=self.finish, ttft_s=self.t_first - self.t_call, queue_s=self.t_start - self.t_call,
            prefill_s=self.t_first - self.t_prefill, decode_s=t_end - self.t_first, selection_s=self.selection_s,
            miss_prefill_s=self.miss_s, prompt_tokens=layout.n - self.link_rows, doc_tokens=layout.doc_tokens,
            question_tokens=len(layout.tail),
            recomputed_tokens=len(self.recomputed) if strat.uses_cache else layout.doc_tokens,
            cache_hits=after.hits - before.hits, cache_misses=after.misses - before.misses,
            stale=after.stale - before.stale, extra=self.extra, recomputed_positions=self.recomputed,
            doc_spans=[(sp.start, sp.end) for sp in layout.docs])))

    def release(self, decoding) -> None:
        """Gives back the sequence's rows and the documents' pins (idempotent)."""
        if self.seq is not None:
            decoding.close(self.seq)
            self.seq = None
        if self.pins:
            self.engine.store.memory.unpin(self.pins)
            self.pins = set()

    def fail(self, decoding, exc: BaseException) -> None:
        try:
            self.release(decoding)
        finally:
            self.sink((ERROR, exc))


class Scheduler:
    """Runs requests on one thread, decoding every running request in one batched step.

    Args:
        engine: the FusionEngine.
        decoding: engine/decode.py's Decoding (arena, decode step).
        max_batch_size: requests decoding at once.
        max_queued_requests: requests waiting for a slot before `submit` refuses.
        cpu_threads: intra-op CPU threads of the scheduler thread alone (engine/threads.py); None: left as the
            process default.
    """

    def __init__(self, engine, decoding, max_batch_size: int, max_queued_requests: int,
                 prefill_tokens_per_step: int = 2048, cpu_threads: int | None = None) -> None:
        # weak: the scheduler's thread must not keep an engine its user dropped alive (with its GPU pool); the
        # engine holds the scheduler, and requests in flight hold their engine
        self._engine = weakref.ref(engine)
        self.cpu_threads = cpu_threads
        self.prefill_budget = prefill_tokens_per_step
        self.decoding = decoding
        self.max_batch = max_batch_size
        self.max_queue = max_queued_requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Lock()  # held while computing: an iteration, or an exclusive operation
        self._cond = threading.Condition()
        self._exclusive_waiters = 0
        self._thread: threading.Thread | None = None
        self._closing = False
        _LIVE.add(self)
        self.last_batch = 0
        self.peak_batch = 0
        self.private_rows_seen: deque[int] = deque(maxlen=4096)  # per request: arena rows it owned
        self.prompt_rows_seen: deque[int] = deque(maxlen=4096)  # per request: rows a private copy would need
        self.steps = 0
        self.done = 0

    @property
    def engine(self):
        eng = self._engine()
        if eng is None:
            raise RuntimeError("the engine is gone")
        return eng

    # -- any thread -----------------------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queues a request (its `sink` set). Raises EngineOverloaded when the queue is full, RuntimeError once
        the engine is shut down."""
        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is shut down")
            if len(self.waiting) >= self.max_queue:
                raise EngineOverloaded(f"{len(self.waiting)} requests are waiting (max_queued_requests="
                                       f"{self.max_queue}); retry later", retry_after_s=1.0)
            self.waiting.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvfuse-scheduler", daemon=True)
                _THREADS.difference_update([t for t in _THREADS if not t.is_alive()])
                _THREADS.add(self._thread)
                self._thread.start()
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        """The engine to oneself between two scheduler iterations (precompute, forget, scoring)."""
        with self._cond:
            self._exclusive_waiters += 1
        try:
            self.lock.acquire()
        finally:
            with self._cond:
                self._exclusive_waiters -= 1
                self._cond.notify_all()
        try:
            yield
        finally:
            self.lock.release()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"running": len(self.running), "queued": len(self.waiting), "batch_size": self.last_batch,
                    "peak_batch_size": self.peak_batch, "decode_steps": self.steps, "requests_done": self.done}

    def shutdown(self, timeout: float | None = None, join_s: float = 60.0) -> None:
        """Stops admitting; waits up to `timeout` seconds (None: forever) for queued and running requests to
        finish, then cancels what is left (it ends at the next step) and waits up to `join_s` for the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.waiting or self.running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    for r in list(self.waiting) + self.running:
                        r.cancel.set()
                    self._cond.notify_all()
                    deadline = None  # cancelled requests end at the next step
                    continue
                self._cond.wait(0.05 if left is None else min(left, 0.05))
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=join_s)

    # -- the scheduler thread -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Serves until shut down or until its engine is garbage-collected: between iterations it holds the engine
        only weakly, so dropping the last reference to an idle engine frees it (and this thread ends)."""
        from .api import _on_device

        if self.cpu_threads is not None:
            set_own_threads(self.cpu_threads)
        while True:
            with self._cond:
                while True:
                    eng = self._engine()
                    if eng is None:  # the engine was collected: nothing can be queued any more
                        self._thread = None
                        return
                    if ((self.waiting or self.running or self._closing or eng.deferred_work)
                            and not self._exclusive_waiters):
                        break
                    del eng
                    self._cond.wait(0.1)
                if self._closing and not self.waiting and not self.running:
                    self._thread = None
                    return
                idle = not self.waiting and not self.running
            with self.lock, _on_device(eng.device), torch.inference_mode():
                if idle:  # nothing to serve: build one cache or index a request deferred, then look again
                    try:
                        eng.build_deferred()
                    except Exception:  # noqa: BLE001  (that document is computed at its next request instead)
                        log.warning("building a deferred cache or index failed", exc_info=True)
                else:
                    self._iteration()
            del eng
            with self._cond:
                self._cond.notify_all()

    def _iteration(self) -> None:
        spent = 0
        while spent < self.prefill_budget:
            with self._cond:
                while self.waiting and self.waiting[0].cancel.is_set():  # closed before it started: nothing computed
                    r = self.waiting.popleft()
                    r.sink((DONE, None))
                    self.done += 1
                req = self.waiting.popleft() if self.waiting and len(self.running) < self.max_batch else None
            if req is None:
                break
            computed = self._admit(req)
            if computed is None:  # waiting for rows
                break
            spent += computed
        if self.running:
            self._step()

    def _admit(self, req: Request) -> int | None:
        """Starts a request; returns the prompt tokens it computed, or None when it has to wait for rows."""
        try:
            going = req.start(self.decoding)
        except _NoRoom:
            if self.running:  # rows free up when a running request ends
                with self._cond:
                    self.waiting.appendleft(req)
                return None
            req.fail(self.decoding, RuntimeError(
                "the request's prompt and answer need more KV rows than the arena holds (raise memory_budget_bytes "
                "or decode_tokens, or lower max_new_tokens)"))
            self._retire(None)
            return 0
        except BaseException as exc:  # noqa: BLE001  (delivered to the request's reader)
            req.fail(self.decoding, exc)
            self._retire(None)
            return 0
        if req.seq is not None:
            self.private_rows_seen.append(req.seq.slab.size)
            self.prompt_rows_seen.append(req.seq.capacity)
        computed = req.layout.n - (req.seq.shared_rows if req.seq is not None else 0)
        if going:
            self.running.append(req)
        else:
            self._finish(req)
        return max(1, computed)

    def _step(self) -> None:
        batch = list(self.running)
        self.last_batch = len(batch)
        self.peak_batch = max(self.peak_batch, len(batch))
        try:
            logits = self.decoding.step([r.seq for r in batch], [r.next_token for r in batch])
            if any(r.guarding for r in batch):  # the guard reads each row's top-2 margin (the same one sync)
                greedy, margins = _top2(logits)
            else:
                greedy, margins = logits.argmax(dim=-1).tolist(), None  # one host sync for the whole batch
        except BaseException as exc:  # noqa: BLE001  (a failed step fails the requests in it, not the engine)
            log.exception("decode step failed")
            for r in batch:
                r.fail(self.decoding, exc)
            self.running = []
            self._retire(None, len(batch))
            return
        self.steps += 1
        ended, failed = [], []
        for b, r in enumerate(batch):
            row = logits[b]
            if margins is not None and r.guarding and margins[b] < r.guard:
                try:  # the guard: this token is a near-tie under the fused cache; full prefill goes on from here
                    row = r.escalate(self.decoding, margins[b])
                except BaseException as exc:  # noqa: BLE001  (delivered to the request's reader)
                    r.fail(self.decoding, exc)
                    failed.append(r)
                    continue
                if row is None:
                    row = logits[b]
                else:
                    greedy[b] = int(row.argmax())
            token = greedy[b] if r.sampler.temperature == 0 else r.sampler(row)
            if not r.accept(token):
                ended.append(r)
        if ended or failed:
            with self._cond:
                self.running = [r for r in batch if r not in ended and r not in failed]
            for r in ended:
                self._finish(r)
            if failed:
                self._retire(None, len(failed))

    def _finish(self, req: Request) -> None:
        try:
            req.complete(self.decoding)
        except BaseException as exc:  # noqa: BLE001
            req.fail(self.decoding, exc)
        self._retire(None)

    def _retire(self, _req, n: int = 1) -> None:
        with self._cond:
            self.done += n
            self._cond.notify_all()


class _Detokenizer:
    """The answer's text, token by token, without decoding the whole answer again at every step (the scheduler
    thread decodes for every running request): the tokenizers library's incremental decoder (it holds back bytes
    of an incomplete character) for a fast tokenizer, a full decode otherwise."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = None
        if self.backend is not None:
            try:
                from tokenizers.decoders import DecodeStream

                self.stream = DecodeStream(skip_special_tokens=True)
            except ImportError:  # an older tokenizers: decode in full
                self.stream = None
        self.tokens: list[int] = []
        self.text = ""

    def add(self, token: int) -> str:
        """Appends a token; returns the text so far."""
        self.tokens.append(token)
        if self.stream is not None:
            chunk = self.stream.step(self.backend, token)
            if chunk:
                self.text += chunk
        else:
            self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return self.text


_LIVE: weakref.WeakSet = weakref.WeakSet()
# every scheduler thread started: one whose engine was collected ends on its own (its scheduler gone from _LIVE),
# and the exit must wait for it too (a thread still tearing down while the interpreter finalises aborts it)
_THREADS: set[threading.Thread] = set()


@atexit.register
def _halt_all() -> None:
    """At interpreter exit: cancel what still runs and let every scheduler thread end on its own (a daemon thread
    stopped by the interpreter inside torch code aborts the process)."""
    for sched in list(_LIVE):
        try:
            sched.shutdown(timeout=0)
        except Exception:  # noqa: BLE001  (exit must go on)
            pass
    for thread in list(_THREADS):
        if thread is not threading.current_thread():
            thread.join(timeout=60.0)


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
