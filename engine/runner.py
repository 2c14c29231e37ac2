"""The layer loop: fused prefill over cached document KV, and decoding.

The runner owns the loop; the model exposes the per-layer seam (`project`, `finish`); the strategy decides
which rows are recomputed; kernels do attention, RoPE, scatter and scores.

Per layer of a fused prefill:
  1. project q/k/v of the active rows (pre-RoPE),
  2. fill the layer's K/V with the cached pre-RoPE rows of every cached segment,
  3. at a check layer, let the strategy shrink the active document rows (fresh vs cached K/V),
  4. scatter the fresh K/V over the cached rows, rotate all keys at their ABSOLUTE positions,
  5. attend: active query at position p sees keys at positions <= p only,
  6. finish the layer for the active rows.
Decoding (engine/decode.py) continues from the prefill's K/V: the rows it computed go to the request's private
arena rows, cached rows are read in place.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.attention import fused_attention
from ..kernels.block_sparse import block_sparse_attention
from ..kernels.causal import causal_attention
from ..kernels.drift import drift_correct
from ..kernels.rope import apply_rope
from ..kernels.scatter import scatter_rows
from .bucketed import LayoutGraphs, check_probe_guard, first_token_gap
from .cudagraph import KEEP_WARM, capture_graph_keeping_warm
from .fusion.base import SelectContext, Strategy, signature
from .models.base import Decoder
from .piecewise import DenseGraphs
from .sources import PooledSource, make_source, pool_rows
from .store.entry import DocKV

__all__ = ["Segment", "PrefillOutput", "Runner"]


@dataclass
class _Plan:
    """Host-side facts of one prefill (what a CUDA graph of it is keyed by)."""

    n: int
    cached: list
    doc_spans: list
    must_host: Tensor
    cand_host: Tensor
    extra_capacity: int
    want_logits: bool
    capture: tuple | None
    budget_tokens: int = 0  # document tokens the ratio applies to (exact documents included)
    question_rows: tuple[int, int] | None = None  # [start, end) of the question's own tokens, when marked

    def probe_rows(self, must_pos: Tensor) -> Tensor | None:
        """[M] bool over `must_pos` (any device): the question's own rows; None when none are marked."""
        if self.question_rows is None:
            return None
        s, e = self.question_rows
        return (must_pos >= s) & (must_pos < e)

    @property
    def must_pos(self) -> Tensor:
        """[M] sorted positions always computed (host)."""
        return torch.arange(self.n)[self.must_host]


class _NullClock:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def seconds(self) -> float:
        return 0.0


class _Clock:
    """Accumulates the time of several intervals without stalling the device.

    On CUDA each interval is a pair of events read once at the end (after the caller's own synchronisation);
    elsewhere a host clock.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pairs: list = []
        self._host = 0.0
        self._t0 = 0.0

    def start(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._pairs.append([ev, None])
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._pairs[-1][1] = ev
        else:
            self._host += time.perf_counter() - self._t0

    def seconds(self) -> float:
        if not self.cuda:
            return self._host
        if self._pairs:
            self._pairs[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self._pairs) / 1e3


@dataclass
class Segment:
    """A run of prompt rows [start, end) served from `kv` (rows of kv: `kv_start ..`), or computed (kv=None).

    `selectable` marks document segments (the strategy may recompute their tokens); the prefix is exact and
    never selected. `exact` marks a document whose cache is exactly what a full prefill computes at these rows
    (the first document right after the cached prefix it was computed after): never selected, but its tokens count
    toward the recompute budget, so its share goes to the other documents. `question` marks the computed rows of
    the question's own tokens (what a query-aware probe may restrict its rows to).
    """

    start: int
    end: int
    kv: DocKV | None
    selectable: bool = True
    exact: bool = False
    question: bool = False


@dataclass
class PrefillOutput:
    logits: Tensor | None  # [vocab] float32 logits of the last prompt token (None when not asked)
    pending: tuple | None  # (source, per-layer fresh rows, n): what Decoding.open writes into the arena
    captured: DocKV | None  # pre-RoPE K/V of the captured rows, when asked
    recomputed: Tensor  # sorted positions of document rows recomputed (after the last check layer)
    selection_s: float = 0.0  # strategy time: probe pass, initial choice, check-layer refinement


class Runner:
    """Runs a Decoder over fused prompts.

    Args:
        decoder: the model, seen through its per-layer seam.
    """

    def __init__(self, decoder: Decoder, cuda_graphs: bool = True, piecewise_graphs: bool = False,
                 bucketed: bool | None = None, idle_captures: bool = False) -> None:
        self.dec = decoder
        self.spec = decoder.spec
        self._cos = self._sin = None
        self._retired: list = []
        self.graphs = _GraphCache(self) if cuda_graphs and decoder.device.type == "cuda" else None
        # first-sight layouts: each layer's dense pieces replayed from graphs per row bucket (engine/piecewise.py)
        self.dense = DenseGraphs(decoder) if self.graphs is not None and piecewise_graphs else None
        # layouts never seen before: one padded prefill per shape bucket, the layout as data (engine/bucketed.py);
        # on CUDA by default, graphed when cuda_graphs is on
        if bucketed is None:
            bucketed = decoder.device.type == "cuda"
        self.layout = LayoutGraphs(self, graphs=cuda_graphs, defer=idle_captures) if bucketed else None

    # -- helpers ---------------------------------------------------------------------------------------
    def rope(self, n: int) -> tuple[Tensor, Tensor]:
        """cos, sin tables covering positions [0, n)."""
        if self._cos is None or self._cos.shape[0] < n:
            if self._cos is not None:  # captured CUDA graphs point at the old tables: keep them alive
                self._retired.append((self._cos, self._sin))
            size = max(n, 256)
            size = 1 << (size - 1).bit_length()
            self._cos, self._sin = self.dec.rope_tables(size)
        return self._cos, self._sin

    def _sync(self) -> None:
        if self.dec.device.type == "cuda":
            torch.cuda.synchronize(self.dec.device)

    def _clock(self) -> _Clock:
        return _Clock(self.dec.device)

    # -- fused prefill ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: Tensor, segments: list[Segment], strategy: Strategy, ratio: float, *,
                extra_capacity: int = 0, capture: tuple[int, int] | None = None,
                want_logits: bool = True, probe_guard: float | None = None) -> PrefillOutput:
        """Fused prefill of one prompt.

        Args:
            ids: [N] token ids of the whole prompt.
            segments: cover [0, N) in order; rows of segments with kv=None are always computed.
            strategy: picks the cached document rows to recompute.
            ratio: the recompute ratio handed to the strategy.
            extra_capacity: rows reserved in the decode cache after the prompt (new tokens).
            capture: (start, end) rows whose pre-RoPE K/V to return as a DocKV (they must be computed rows).
            want_logits: compute the last token's logits.
            probe_guard: with a strategy that probes (`probe_layers`), the probe runs on to the last layer and its
                last row's first-token top-2 gap (the prompt over the cached documents, nothing recomputed) is read
                on the host; below this many nats ProbeGuardTripped is raised before the fused pass
                (GenerationOptions.guard_at="probe"). Ignored when no probe runs.
        Returns:
            PrefillOutput.

        Raises:
            ProbeGuardTripped: see `probe_guard`.
        """
        dev = self.dec.device
        n = int(ids.numel())
        plan = self.plan(n, segments, strategy, extra_capacity=extra_capacity, capture=capture,
                         want_logits=want_logits)
        guarded = probe_guard is not None
        bucket = (self.layout.plan(plan, ids, strategy, ratio, probe_gap=guarded) if self.layout is not None
                  else None)
        if bucket is not None:
            self.rope(max(n + extra_capacity, bucket.nb + 1))
            clock = self._clock()
            logits, pending, recomputed = self.layout.run(bucket, strategy, ratio, clock, probe_guard)
            return PrefillOutput(logits=logits, pending=pending, captured=None, recomputed=recomputed,
                                 selection_s=clock.seconds())
        # a whole-prefill graph holds no host read between its probe and its fused pass: a guarded probe runs eagerly
        key = None if guarded else self._graph_key(plan, strategy, ratio)
        if key is not None:
            out = self.graphs.run(key, plan, ids, strategy, ratio)
            if out is not None:
                return out
        self.rope(n + extra_capacity)
        return self._device_prefill(plan, ids.to(dev), plan.cand_host.to(dev), plan.must_pos.to(dev), strategy,
                                    ratio, self._clock(), probe_guard=probe_guard)

    def plan(self, n: int, segments: list[Segment], strategy: Strategy, *, extra_capacity: int = 0,
             capture: tuple[int, int] | None = None, want_logits: bool = True) -> _Plan:
        """The host facts of a prefill: which rows are cached, candidates, computed rows, the budget's base.
        Index sets are built on the host from the segment spans: no device round trip in the hot path."""
        must_host = torch.ones(n, dtype=torch.bool)
        doc_spans, cached, budget_tokens = [], [], 0
        question = [(seg.start, seg.end) for seg in segments if seg.question and seg.kv is None and seg.end > seg.start]
        for seg in segments:
            if seg.kv is not None and strategy.uses_cache:
                must_host[seg.start:seg.end] = False
                cached.append(seg)
                if seg.selectable and not seg.exact:
                    doc_spans.append((seg.start, seg.end))
                if seg.selectable or seg.exact:
                    budget_tokens += seg.end - seg.start
        if want_logits and not bool(must_host[-1]):
            raise RuntimeError("the last prompt token must be computed")
        arange = torch.arange(n)
        cand_host = torch.cat([arange[s:e] for s, e in doc_spans]) if doc_spans else arange[:0]
        return _Plan(n=n, cached=cached, doc_spans=doc_spans, must_host=must_host, cand_host=cand_host,
                     extra_capacity=extra_capacity, want_logits=want_logits, capture=capture,
                     budget_tokens=budget_tokens,
                     question_rows=(min(s for s, _ in question), max(e for _, e in question)) if question else None)

    def _device_prefill(self, plan: _Plan, ids: Tensor, candidates: Tensor, must_pos: Tensor, strategy: Strategy,
                        ratio: float, clock, source=None, probe_guard: float | None = None) -> PrefillOutput:
        """Everything after the host bookkeeping: device tensors in, logits out, no host synchronisation (so a
        CUDA graph can capture it), bar the probe guard's one read (`prefill`)."""
        cached = plan.cached
        cos, sin = self._cos, self._sin
        ctx = SelectContext(n_layers=self.spec.n_layers, ratio=ratio, candidates=candidates,
                            doc_spans=plan.doc_spans, question=must_pos, budget_tokens=plan.budget_tokens,
                            doc_extras=[seg.kv.extras for seg in cached if seg.selectable and not seg.exact],
                            exact_spans=[(seg.start, seg.end) for seg in cached if seg.exact],
                            exact_extras=[seg.kv.extras for seg in cached if seg.exact])
        probe_layers = strategy.probe_layers(self.spec.n_layers) if cached else ()
        if probe_layers:
            ctx.probe_rows = plan.probe_rows(must_pos)  # only a probe reads it
            clock.start()
            view = strategy.probe_keys(ctx)
            keys = None if view is None else torch.unique(torch.cat([view.to(ids.device), must_pos]))
            probe = self._layers(ids, cached, must_pos, must_pos[:0], cos, sin, False, strategy, ctx,
                                 probe_layers=probe_layers, probe_keys=keys, source=source,
                                 through_last=probe_guard is not None)
            ctx.question_attention = probe.probes
            clock.stop()
            if probe_guard is not None:  # the probe ran to the last layer: its last row is the last prompt row
                check_probe_guard(first_token_gap(self.dec, probe.h[-1:]), probe_guard)

        clock.start()
        chosen = (strategy.initial(ctx) if cached else candidates).to(ids.device)
        active = torch.sort(torch.cat([must_pos, chosen])).values
        clock.stop()
        run = self._layers(ids, cached, active, chosen, cos, sin, plan.want_logits, strategy, ctx,
                           capture=plan.capture, must_pos=must_pos, clock=clock, source=source)
        logits = self.dec.logits(run.h[-1:])[0].float() if plan.want_logits else None
        return PrefillOutput(logits=logits, pending=run.pending, captured=run.captured, recomputed=run.active_docs,
                             selection_s=clock.seconds())

    def _graph_key(self, plan: _Plan, strategy: Strategy, ratio: float):
        """The CUDA-graph signature of a request, or None when it cannot be replayed from a graph."""
        if self.graphs is None or not plan.want_logits or plan.capture is not None:
            return None
        if not getattr(strategy, "graph_safe", False) or strategy.drift:
            return None
        pools = {id(seg.kv.pool) for seg in plan.cached}
        if plan.cached and (len(pools) != 1 or plan.cached[0].kv.pool is None
                            or plan.n > plan.cached[0].kv.pool.scratch_rows):
            return None
        sig = signature(strategy)
        if sig is None:
            return None
        spans = tuple((seg.start, seg.end, seg.selectable, seg.exact) for seg in plan.cached)
        return (*sig, float(ratio), plan.n, plan.extra_capacity, spans, plan.question_rows, tuple(pools))

    @dataclass
    class _Run:
        h: Tensor
        active: Tensor
        active_docs: Tensor
        captured: DocKV | None
        probes: dict
        pending: tuple | None  # (source, fresh, n); fresh per layer: (positions, k, v) computed there, pre-RoPE

    def _layers(self, ids, cached, active, active_docs, cos, sin, keep, strategy, ctx, *, capture=None,
                must_pos=None, probe_layers=(), probe_keys=None, clock=None, source=None,
                through_last: bool = False) -> Runner._Run:
        """The layer loop over `active` rows.

        Cached rows are read through a source (pool rows in place, or per-layer assembled buffers); the
        computed rows' fresh K/V go to their scratch rows. With `probe_layers`, records question attention over
        all keys and stops after the deepest probe layer (`through_last`: after the last layer); `probe_keys`
        (sorted positions) then restricts what the probed rows attend to, so their states come from a compressed
        view.
        """
        dec, spec = self.dec, self.spec
        pieces = self.dense if self.dense is not None and not self.dense.suspended else None
        project, finish = (pieces.project, pieces.finish) if pieces is not None else (dec.project, dec.finish)
        own = (lambda t: t.clone()) if pieces is not None else (lambda t: t)  # graph outputs are reused buffers
        n = int(ids.numel())
        dev = ids.device
        check = set(strategy.check_layers(spec.n_layers)) if (cached and not probe_layers) else set()
        last_layer = max(probe_layers) if probe_layers and not through_last else spec.n_layers - 1
        src = source or make_source([(seg.start, seg.end, seg.kv) for seg in cached], n,
                                    (spec.n_kv_heads, spec.head_dim), dec.dtype, dev)
        h = dec.embed_tokens(ids[active])
        cap_k, cap_v, fresh = [], [], []
        probes: dict[int, Tensor] = {}
        kv_pos = torch.arange(n, device=dev)
        rows_all = src.base_rows if probe_keys is None else src.base_rows[probe_keys]
        pos_all = kv_pos if probe_keys is None else probe_keys
        plain = not cached and probe_keys is None  # a plain causal prefill: no cache read, nothing to scatter
        sparse = getattr(strategy, "sparse_plan", None) if plain else None
        drift = _Drift(strategy, ctx, src, must_pos, n, spec.n_layers) \
            if cached and not probe_layers and must_pos is not None and strategy.drift else None
        per_active = rope_active = None
        for i in range(last_layer + 1):
            if plain:
                q, k, v = project(i, h)
                if keep:
                    fresh.append((active, own(k), own(v)))
                if capture is not None:
                    cap_k.append(k[capture[0]:capture[1]].clone())
                    cap_v.append(v[capture[0]:capture[1]].clone())
                c, s_ = cos[:n], sin[:n]
                if sparse is not None:  # sift: each query block attends to its listed key blocks only
                    plan, _, block = sparse
                    qr, kr = apply_rope(q, c, s_), apply_rope(k, c, s_)
                    li, ci = plan.layer(i, qr, kr)  # fixed by the marks, or picked from this layer's q and k
                    o = block_sparse_attention(qr, kr, v, li, ci, block, spec.scale)
                else:
                    o = causal_attention(apply_rope(q, c, s_), apply_rope(k, c, s_), v, spec.scale)
                h = finish(i, h, o)
                continue
            kpool, vpool = src.layer(i)
            src.prefetch(i + 1, last_layer + 1)
            q, k, v = project(i, h)
            if i in check:
                clock.start()
                doc_rows = torch.searchsorted(active, active_docs)  # their rows among the active ones
                ctx.layer = i
                ctx.active = active_docs
                ctx.fresh_k, ctx.fresh_v = k[doc_rows], v[doc_rows]
                base = src.base_rows[active_docs]
                ctx.cached_k, ctx.cached_v = kpool.index_select(0, base), vpool.index_select(0, base)
                active_docs = strategy.refine(ctx).to(dev)
                ctx.fresh_k = ctx.fresh_v = ctx.cached_k = ctx.cached_v = None
                new_active = torch.sort(torch.cat([must_pos, active_docs])).values
                clock.stop()
            else:
                new_active = None
            if per_active is None:  # index tensors that only change with the active set
                scratch = src.scratch_rows[active]
                if src.identity and probe_keys is None:
                    rows = None  # position p is row p: no gather needed
                else:
                    rows = rows_all.clone()
                    rows[active if probe_keys is None else torch.searchsorted(probe_keys, active)] = scratch
                per_active = (scratch, rows)
            scratch, rows = per_active
            drifting = drift is not None and drift.write(i, src, kpool, vpool, active, k, v)
            scatter_rows(kpool, scratch, k)
            scatter_rows(vpool, scratch, v)
            if drifting:  # every candidate reads its corrected (or fresh) row here, and decoding does too
                rows = drift.rows(rows)
                if keep:
                    fresh.append(drift.taken(src, kpool, vpool))
            elif keep:
                fresh.append((active, own(k), own(v)))
            if capture is not None:
                lo = int(torch.searchsorted(active, capture[0]))
                hi = int(torch.searchsorted(active, capture[1]))
                cap_k.append(k[lo:hi].clone())
                cap_v.append(v[lo:hi].clone())
            if new_active is not None:
                sel = torch.searchsorted(active, new_active)
                q, h, active = q[sel], h[sel], new_active
                per_active = rope_active = None
            if rope_active is None:
                rope_active = (cos[active], sin[active])
            qr = apply_rope(q, *rope_active)
            if i in probe_layers:
                from ..kernels.attn_scores import attention_scores

                full_rows = src.base_rows.clone()
                full_rows[active] = src.scratch_rows[active]
                # slot p holds position p: kv_pos None
                probes[i] = attention_scores(qr, active, kpool, full_rows, None, cos, sin, spec.scale)
            o = fused_attention(qr, active, kpool, vpool, rows,
                                None if rows is not None and probe_keys is None else pos_all, cos, sin, spec.scale)
            h = finish(i, h, o)
            src.done_with(i)
        captured = DocKV(torch.stack(cap_k), torch.stack(cap_v)) if capture is not None else None
        return Runner._Run(h=h, active=active, active_docs=active_docs, captured=captured, probes=probes,
                           pending=(src, fresh, n) if keep else None)


class _Drift:
    """The drift correction in the eager loop (kernels/drift.py): every candidate's corrected row goes to its
    scratch row before the fresh rows go over theirs; from the first drift layer on, the attention reads every
    candidate there and decoding takes every computed or candidate row as the request's own. Whole-prefill graphs
    are not used with it (`Runner._graph_key`); shape-bucket graphs do the same (bucketed._BucketDrift)."""

    def __init__(self, strategy, ctx: SelectContext, src, must_pos: Tensor, n: int, n_layers: int) -> None:
        dev = must_pos.device
        self.alpha, self.start = float(strategy.drift), strategy.drift_layer(n_layers)
        self.n_docs = len(ctx.doc_spans)
        self.doc_of = torch.full((n,), -1, dtype=torch.long, device=dev)
        for d, (s, e) in enumerate(ctx.doc_spans):
            self.doc_of[s:e] = d
        cand = ctx.candidates.to(dev)
        self.cand, self.slot_base, self.dst = cand, src.base_rows[cand], src.scratch_rows[cand]
        self.slot_doc = self.doc_of[cand]
        self.every = torch.sort(torch.cat([must_pos, cand])).values  # computed rows are must rows or candidates
        self._active = self._rows_in = None  # the last layer's inputs and what was derived from them (reused while
        #   the active rows, and the row map, stay the same: every layer after a check layer)

    def write(self, i: int, src, kpool: Tensor, vpool: Tensor, active: Tensor, k: Tensor, v: Tensor) -> bool:
        """Layer i's corrected rows written (True), or nothing to do (before the first drift layer)."""
        if i < self.start or self.n_docs == 0:
            return False
        if self._active is None or self._active[0] is not active:
            self._active = (active, src.base_rows[active], self.doc_of[active])
        _, fresh_base, fresh_doc = self._active
        drift_correct(kpool, vpool, k, v, fresh_base, fresh_doc, self.slot_base, self.slot_doc, self.dst, self.n_docs,
                      self.alpha)
        return True

    def rows(self, rows: Tensor | None) -> Tensor | None:
        """The attention's row map with every candidate at its scratch row (None: position p is row p already)."""
        if rows is None:
            return None
        if self._rows_in is None or self._rows_in[0] is not rows:
            self._rows_in = (rows, rows.index_copy(0, self.cand, self.dst))
        return self._rows_in[1]

    def taken(self, src, kpool: Tensor, vpool: Tensor):
        """(positions, k, v) decoding takes from this layer: every computed or candidate row."""
        at = src.scratch_rows[self.every]
        return self.every, kpool.index_select(0, at), vpool.index_select(0, at)


class _GraphCache:
    """CUDA graphs of whole fused prefills, keyed by request signature (strategy, ratio, length, layout).

    A signature is captured the second time it is seen (a one-off request never pays for a capture) and replayed
    afterwards with the new token ids and document rows copied into the graph's static inputs. At most
    `max_graphs` are kept (each holds its activations and decode cache). A capture that fails (an operation that
    synchronises the host) marks the signature eager for good.
    """

    def __init__(self, runner: Runner, max_graphs: int = 4) -> None:
        self.runner = runner
        self.max_graphs = max_graphs
        self.seen: dict = {}
        self.entries: dict = {}
        self.eager: set = set()
        self.keep_warm = KEEP_WARM  # as LayoutGraphs.keep_warm (True: the capturing request answers from its warm-up)

    def run(self, key, plan: _Plan, ids: Tensor, strategy: Strategy, ratio: float) -> PrefillOutput | None:
        if key in self.eager:
            return None
        entry = self.entries.get(key)
        if entry is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < 2:
                return None
            try:
                entry, warm = self._capture(plan, ids, strategy, ratio)
            except Exception:  # noqa: BLE001  (any capture failure means: run this signature eagerly)
                torch.cuda.synchronize()
                self.eager.add(key)
                return None
            if len(self.entries) >= self.max_graphs:
                self.entries.pop(next(iter(self.entries)))
            self.entries[key] = entry
            if self.keep_warm:
                return warm  # the capture's warm-up run computed this request: no replay on top
        else:
            self.entries[key] = self.entries.pop(key)  # most recently used last
        graph, static_ids, source, out, _ = entry
        static_ids.copy_(ids, non_blocking=True)
        if source is not None:
            source.base_rows.copy_(_plan_rows(plan, source.pool).to(source.scratch_rows.device), non_blocking=True)
        graph.replay()
        return out  # its logits and pending rows are the graph's static outputs: read before the next replay

    def _capture(self, plan: _Plan, ids: Tensor, strategy: Strategy, ratio: float):
        r = self.runner
        dev = r.dec.device
        r.rope(plan.n + plan.extra_capacity)
        static_ids = ids.to(dev).clone()
        cand = plan.cand_host.to(dev)
        must = plan.must_pos.to(dev)
        source = None
        if plan.cached:
            pool = plan.cached[0].kv.pool
            scratch = torch.arange(pool.scratch_start, pool.scratch_start + plan.n, device=dev)
            source = PooledSource.from_rows(pool, _plan_rows(plan, pool).to(dev), scratch)
        if r.dense is not None:
            r.dense.suspended += 1  # the whole prefill is captured: its dense pieces run eagerly inside
        try:
            graph, out, warm = capture_graph_keeping_warm(
                lambda: r._device_prefill(plan, static_ids, cand, must, strategy, ratio, _NullClock(), source), dev)
        finally:
            if r.dense is not None:
                r.dense.suspended -= 1
        # every tensor the graph reads must outlive it: the candidate and question index sets are kept too
        return (graph, static_ids, source, out, (cand, must)), warm



def _plan_rows(plan: _Plan, pool) -> Tensor:
    return pool_rows([(seg.start, seg.end, seg.kv) for seg in plan.cached], plan.n, pool)
