"""Layout-free fused prefills: one CUDA graph per shape bucket, the layout passed as data.

Every RAG request brings a new layout (document count, lengths, which rows are recomputed), so a graph keyed by
the exact layout almost never replays. Here the shapes of a prefill depend only on its *bucket*:

- N: prompt rows, rounded up, keys past the prompt are masked by position (they sit at positions >= n, after every
  real query, so the attention kernels never visit them); 8 steps per octave for `full` (at most ~12% padding: it
  computes every row), 2 for fused prefills, whose cost barely depends on N (they compute M + K rows, their
  attention stops at the last real position; only the probe's scores and the top-k read N rows), 4 for
  cacheblend's kind (its layers up to the check compute every row);
- M: rows that are always computed (question, chat suffix, glue): at least 32, then 2 steps per octave;
- K: document rows recomputed, rounded up (4 steps per octave; the real count is a device scalar);
- V (qcfuse's compressed probe view): 4 steps per octave.

M, K and V are coarse on purpose: a request's bucket is the product of the sizes, and real traffic (documents of
every length, questions of every length) spreads over that product. With M at 4 and K at 8 steps per octave and 24
graphs, a simulated stream of 3-10 documents of 128-1024 tokens and 10-120-token questions met 420 buckets and,
in steady state, 90% of its requests paid a capture (the cache filled, started over, filled again); with these
steps and 512 graphs, 210 buckets and 97% replays, for 11% more computed rows (`benchmarks/bucket_traffic.py`). A
fused bucket's graph holds no per-layer outputs (its fresh K/V stay in the pool's scratch rows and are read when
the sequence opens), so hundreds fit in memory. When the cache is full (`max_graphs`, or `max_bytes` of static
outputs) the least recently used bucket is dropped, not all of them (`LayoutGraphs.make_room`): graphs replay one
at a time, so a dropped bucket's outputs go back to the shared memory pool for later captures to reuse.

The layout (token ids, the pool row of every position, the candidate mask, the always-computed positions, the
number of rows to keep) is copied into static buffers; padded query rows carry position -1, so they see no key,
write their K/V to a trash row and are never read. Selection runs on the device: a strategy whose choice is a
top-k of scores (`Strategy.scores` after a question probe, `Strategy.refine_scores` at a check layer) gets its
top-K over the masked scores, the first `k` kept; a strategy whose choice depends on the layout alone (`epic`,
`reuse`) is asked on the host, its positions copied in like the rest. `full` is a plain causal prefill padded to N.

On CUDA this is the path of every eligible request, captured or not (`graphs=False` runs the same padded
functions eagerly), so a request gives the same tokens whatever its layout's history. A bucket runs eagerly the
first time it is seen and is captured the second time, on that request's path; with `keep_warm` that request
answers from the capture's warm-up run (it computes once plus the recording, instead of twice). Recording costs about
as much as running the kernels eagerly, so where the host dominates that request still costs about twice an eager
run. With `defer` (EngineConfig.idle_captures, off by default) it runs eagerly instead and the capture waits for the
engine's idle time (`capture_deferred`, called by the scheduler between requests, as deferred document caches are
built); a bucket seen again before the engine was idle is captured on that request's path. Selection (probe +
top-k) is its own graph, so its time is measured apart (`selection_s`). The exact-layout graphs of
`engine/runner.py` remain for what is not eligible.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.attention import fused_attention
from ..kernels.attn_scores import attention_and_scores, attention_scores
from ..kernels.causal import causal_attention
from ..kernels.drift import drift_correct
from ..kernels.rope import apply_rope
from ..kernels.scatter import scatter_rows
from .cudagraph import KEEP_WARM, capture_graph_keeping_warm
from .fusion.base import SelectContext, signature
from .sources import AssembledSource, PooledSource, PoolRows, pool_rows

__all__ = ["bucket_size", "bucket_sizes", "n_steps", "monotone_runs", "plan_buckets", "strategy_kind", "LayoutGraphs", "M_MIN", "M_STEPS", "K_STEPS", "V_STEPS", "FUSED_ROW_STEPS", "CHECK_ROW_STEPS"]

FUSED_ROW_STEPS = 2     # prompt rows of a fused prefill: 2 sizes per octave (full: LayoutGraphs.row_steps)
CHECK_ROW_STEPS = 4     # ... of one with a check layer (cacheblend: every row is computed up to it)
M_MIN, M_STEPS = 32, 2  # always-computed rows: at least 32, then 2 sizes per octave
K_STEPS = 4             # recomputed document rows: 4 sizes per octave
V_STEPS = 4             # a compressed probe view's keys: 4 sizes per octave
DRIFT_TABLE_ROWS = 512  # documents of the drift correction's table in a bucket (more: the next power of two)
MAX_CAPTURE_BACKLOG = 64  # buckets waiting for idle time to be captured (more: the oldest are forgotten)

log = logging.getLogger("kvfuse.runner")


def bucket_size(x: int, steps: int, minimum: int) -> int:
    """x rounded up to the next of `steps` evenly spaced sizes per octave (at least `minimum`; 0 stays 0)."""
    if x <= 0:
        return 0
    if x <= minimum:
        return minimum
    grain = max(1, (1 << (x.bit_length() - 1)) // steps)
    return -(-x // grain) * grain


def strategy_kind(strategy, n_layers: int) -> str | None:
    """How the bucketed path runs a strategy: "plain" (full), "probe" (top-k after a question probe), "check"
    (top-k at one check layer: cacheblend), "host" (chosen on the host from the layout), None (not eligible)."""
    if not getattr(strategy, "layout_free", False):
        return None
    if not strategy.uses_cache:
        return "plain"
    if strategy.probe_layers(n_layers):
        if strategy.check_layers(n_layers) or not hasattr(strategy, "scores"):
            return None
        return "probe"
    if strategy.check_layers(n_layers):
        if len(strategy.check_layers(n_layers)) != 1 or strategy.refine_scores is None:
            return None
        return "check"
    return "host"


def n_steps(kind: str, row_steps: int = 8) -> int:
    """Prompt-row (N) bucket sizes per octave of a request of `kind` (`row_steps`: full's)."""
    return {"plain": row_steps, "check": CHECK_ROW_STEPS}.get(kind, FUSED_ROW_STEPS)


def bucket_sizes(kind: str, n: int, m: int, k: int, row_steps: int = 8) -> tuple[int, int, int]:
    """(N, M, K) bucket of a request of `kind` with n prompt rows, m always-computed and k recomputed rows."""
    return bucket_size(n, n_steps(kind, row_steps), 64), bucket_size(m, M_STEPS, M_MIN), bucket_size(k, K_STEPS, 16)


def monotone_runs(f, lo: int, hi: int) -> list[tuple[int, int]]:
    """The maximal runs [a, b] of [lo, hi] on which a nondecreasing integer function f is constant, largest
    first, found by bisection (O(runs x log range) calls of f, not one per integer)."""
    runs: list[tuple[int, int]] = []
    b = hi
    while b >= lo:
        v, a, top = f(b), lo, b
        while a < top:  # the smallest x in [a, b] with f(x) == f(b)
            mid = (a + top) // 2
            if f(mid) == v:
                top = mid
            else:
                a = mid + 1
        runs.append((a, b))
        b = a - 1
    return runs


def plan_buckets(kind: str, lo: int, hi: int, q_lo: int, q_hi: int, prefix: int, k_of,
                 row_steps: int = 8, min_body: int = 32) -> dict[tuple, tuple[int, int]]:
    """One (prompt rows, tail rows) request per shape bucket that requests of `kind` with lo..hi prompt rows and
    q_lo..q_hi tail rows meet, the largest of each bucket; k_of(body) is the recomputed rows of a request with
    `body` document rows (nondecreasing). Keys are `bucket_sizes`' as `LayoutGraphs.plan` computes them (a plain
    prefill computes every row: M follows N, K is 0). Every integer pair of the ranges is covered: within one
    (N, M) bucket the body n - prefix - q takes every value of an interval, and K follows it monotonically."""
    steps = n_steps(kind, row_steps)
    points: dict[tuple, tuple[int, int]] = {}
    m_runs = [(q_lo, q_hi)] if kind == "plain" else monotone_runs(lambda q: bucket_size(q, M_STEPS, M_MIN), q_lo, q_hi)
    for n0, n1 in monotone_runs(lambda n: bucket_size(n, steps, 64), lo, hi):
        for q0, q1 in m_runs:
            b_lo, b_hi = max(min_body, n0 - prefix - q1), n1 - prefix - q0
            if b_lo > b_hi:
                continue
            k_runs = [(b_lo, b_hi)] if kind == "plain" else \
                monotone_runs(lambda b: bucket_size(k_of(b), K_STEPS, 16), b_lo, b_hi)
            for _, body in k_runs:
                n = min(n1, body + prefix + q1)
                q = n - prefix - body
                m = n if kind == "plain" else q
                points.setdefault(bucket_sizes(kind, n, m, k_of(body), row_steps), (n, q))
    return points


@dataclass
class _Host:
    """Host facts of one request in its bucket."""

    kind: str  # "plain" (full), "host" (chosen on the host), "probe" (top-k after a probe), "check" (cacheblend)
    n: int
    nb: int
    m: int
    mb: int
    k: int
    kb: int
    key: tuple
    packed: Tensor  # int64 [width]: every per-request input in one host tensor (one copy to the device)
    pre: Tensor | None  # check kind: [p] positions computed through the check layer
    pool: object = None  # the KVPool every cached row lives in (None: plain)
    check: int = -1  # check kind: the check layer
    vb: int = 0  # probe kind: bucket of the probe's compressed key view (0: the probe sees every key)
    gap: bool = False  # probe kind: the probe also runs to the last layer and gives the first token's top-2 gap
    drift: int = -1  # the drift correction's first layer (strategy.drift; -1: off)
    db: int = 0  # its per-document table's rows (>= the documents; a power of two)
    every: Tensor | None = None  # with drift: computed and candidate positions (host), private from its first layer


class _Inputs:
    """Views of one packed int64 device buffer: the request's layout as data."""

    def __init__(self, buf: Tensor, nb: int, mb: int, kb: int, vb: int = 0) -> None:
        self.buf = buf
        o = 0

        def take(size: int) -> Tensor:
            nonlocal o
            view = buf[o:o + size]
            o += size
            return view

        self.ids = take(nb)            # [N] token ids (0 past the prompt)
        self.base = take(nb + 1)       # [N + 1] pool row of each position (+ a trash slot)
        self.must = take(mb)           # [M] always-computed positions (-1 = padding)
        self.cand = take(nb)           # [N] d + 1 where the position is a row of candidate document d, else 0
        self.pre = take(nb)            # [N] check kind: slot p holds p if computed up to the check layer, else -1
        self.chosen = take(kb)         # [K] host kind: chosen positions (-1 = padding)
        self.scalars = take(4)         # [k, index of the last prompt row among the final active rows,
        #                                 start, end of the question's own rows (0, N when none are marked)]
        self.view = take(vb)           # [V] probe kind with a compressed view: the positions the probed rows
        #                                 attend to, ascending (-1 = padding, last)

    @staticmethod
    def width(nb: int, mb: int, kb: int, vb: int = 0) -> int:
        return nb + nb + 1 + mb + nb + nb + kb + 4 + vb


class ProbeGuardTripped(Exception):
    """GenerationOptions.guard_at="probe": the question probe's first token is a near-tie (its top-2 gap below the
    request's guard), so the fused pass is not run; full prefill answers instead."""

    def __init__(self, margin: float) -> None:
        super().__init__(margin)
        self.margin = margin


def first_token_gap(dec, x_last: Tensor) -> Tensor:
    """[1] the top-2 logit gap (nats, fp32) of the final hidden state `x_last` [1, hidden]; no host read (graph-safe).
    Both prefill paths' probe guards compute it here."""
    top = dec.logits(x_last)[0].float().topk(2).values
    return (top[0] - top[1]).view(1)


def check_probe_guard(gap: Tensor | None, guard: float | None) -> None:
    """Reads the probe's gap on the host (the one synchronisation the probe guard costs) and trips below `guard`."""
    if guard is None or gap is None:
        return
    margin = float(gap[0])
    if margin < guard:
        raise ProbeGuardTripped(margin)


def _real_first(pos: Tensor) -> Tensor:
    """Positions sorted ascending with the -1 padding last."""
    key = torch.where(pos >= 0, pos, torch.iinfo(torch.int64).max)
    return pos[torch.sort(key).indices]


class LayoutGraphs:
    """Bucketed fused prefills of one Runner (see the module docstring).

    Args:
        runner: the Runner (its decoder, RoPE tables and clock).
        graphs: capture and replay CUDA graphs (False: run the same padded functions eagerly).
        max_graphs: buckets kept captured (least recently used dropped).
        max_bytes: bound of the captured buckets' static outputs (their prompt K/V rows), least recently used
            dropped beyond it; intermediates share one memory pool.
        row_steps: prompt-row (N) bucket sizes per octave.
        defer: a bucket due for capture runs eagerly and is captured in idle time (`capture_deferred`,
            EngineConfig.idle_captures); seen again before that, on the request's path. False: captured on the path
            of the request that makes it due.
    """

    # sightings of a bucket before it is captured (`FusionEngine.warmup` sets 1 while it runs)
    capture_after_default = 2

    def __init__(self, runner, graphs: bool, max_graphs: int = 512, max_bytes: int = 8 << 30,
                 row_steps: int = 8, defer: bool = False) -> None:
        self.runner = runner
        self.row_steps = row_steps  # prompt-row buckets per octave (N): more steps, less padding, more graphs
        self.dec = runner.dec
        self.spec = runner.spec
        self.graphs = graphs and self.dec.device.type == "cuda"
        self.max_graphs = max_graphs
        self.max_bytes = max_bytes
        self.sizes: dict = {}
        self.seen: dict = {}
        self.entries: dict = {}
        self.failed: dict = {}  # bucket key -> why its capture failed (it runs eagerly for good)
        self.capture_after = self.capture_after_default  # sightings of a bucket before it is captured
        # True: the capturing request answers from its capture's warm-up run (it computes once); False: the new
        # graph is replayed on top (twice; used by tests/engine/test_bucketed.py only: the default measured 1.07-1.81x
        # faster on an H100, docs/gpu/README.md).
        self.keep_warm = KEEP_WARM
        self.defer = defer
        self.backlog: OrderedDict = OrderedDict()  # bucket key -> (host facts, strategy, ratio) of its last request
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.replays = self.captures = self.eager_runs = 0
        self.evictions = 0  # buckets dropped to make room (least recently used first)

    # -- host side --------------------------------------------------------------------------------------
    def plan(self, plan, ids: Tensor, strategy, ratio: float, probe_gap: bool = False) -> _Host | None:
        """The request's bucket and packed inputs, or None when it is not eligible. `probe_gap`: the probe also
        reads its last row's first-token top-2 gap (GenerationOptions.guard_at="probe"; `run`'s `probe_guard`)."""
        if not getattr(strategy, "layout_free", False) or not plan.want_logits or plan.capture is not None:
            return None
        n, spec = plan.n, self.spec
        cached = plan.cached
        pool = None
        if strategy.uses_cache and cached:
            pools = {id(seg.kv.pool) for seg in cached}
            pool = cached[0].kv.pool
            if len(pools) != 1 or pool is None or pool.k.device != self.dec.device:
                return None
        kind = strategy_kind(strategy, spec.n_layers)
        if kind is None or (kind != "plain" and not cached):  # nothing cached: the exact path is a plain prefill
            return None
        drift = strategy.drift_layer(spec.n_layers) if kind != "plain" else None
        if drift is not None and kind == "check" and drift <= strategy.check_layers(spec.n_layers)[0]:
            return None  # a drift layer at or before the check layer: the eager loop handles it
        # the drift table's rows: a bound, not the count, so the document count does not split buckets
        db = 0 if drift is None else max(DRIFT_TABLE_ROWS, 1 << (len(plan.doc_spans) - 1).bit_length())
        if pool is not None and n >= pool.scratch_rows:  # slot p holds position p; the last one is the trash row
            return None
        must = plan.must_pos
        m = int(must.numel())
        ctx = SelectContext(n_layers=spec.n_layers, ratio=ratio, candidates=plan.cand_host,
                            doc_spans=plan.doc_spans, question=must, budget_tokens=plan.budget_tokens,
                            doc_extras=[seg.kv.extras for seg in cached if seg.selectable and not seg.exact],
                            exact_spans=[(seg.start, seg.end) for seg in cached if seg.exact],
                            exact_extras=[seg.kv.extras for seg in cached if seg.exact])
        chosen = None
        if kind == "plain":
            k = 0
        elif kind == "host":
            chosen = torch.sort(strategy.initial(ctx).cpu().long()).values
            k = int(chosen.numel())
        else:
            k = ctx.budget
            if k == 0 and kind == "probe":  # nothing to choose: the probe's answer is not needed
                kind, chosen = "host", torch.zeros(0, dtype=torch.long)
        nb, mb, kb = bucket_sizes(kind, n, m, k, self.row_steps)
        view = strategy.probe_keys(ctx) if kind == "probe" else None  # host work: the plan's own tensors
        if view is not None:
            view = torch.unique(torch.cat([view.cpu().long(), must.long()]))
        vb = 0 if view is None else bucket_size(int(view.numel()), V_STEPS, 64)
        sig = signature(strategy)
        if sig is None:
            return None
        gap = bool(probe_gap) and kind == "probe"
        key = (*sig, kind, nb, mb, kb, vb, gap, db, id(pool))
        packed = torch.zeros(_Inputs.width(nb, mb, kb, vb), dtype=torch.long)
        v = _Inputs(packed, nb, mb, kb, vb)
        if view is not None:
            v.view.fill_(-1)
            v.view[:view.numel()] = view
        v.ids[:n] = ids.cpu()
        if pool is not None:
            base = pool_rows([(seg.start, seg.end, seg.kv) for seg in cached], n, pool)
            v.base[:n] = base
            v.base[n:] = base[0]  # keys past the prompt: masked by position; a row that holds finite values
        v.must.fill_(-1)
        v.must[:m] = must
        for d, (s, e) in enumerate(plan.doc_spans):
            v.cand[s:e] = d + 1
        v.pre.fill_(-1)
        pre = None
        if kind == "check":  # every computed and candidate position, ascending: marked, not sorted (O(n))
            mark = torch.zeros(n, dtype=torch.bool)
            mark[must] = True
            mark[plan.cand_host] = True
            pre = mark.nonzero().squeeze(1)
            v.pre[pre] = pre
        v.chosen.fill_(-1)
        if chosen is not None:
            v.chosen[:k] = chosen
        a = n if kind == "plain" else m + k
        v.scalars[0] = k
        v.scalars[1] = a - 1
        v.scalars[2], v.scalars[3] = plan.question_rows or (0, n)
        check = strategy.check_layers(spec.n_layers)[0] if kind == "check" else -1
        return _Host(kind=kind, n=n, nb=nb, m=m, mb=mb, k=k, kb=kb, key=key, packed=packed, pre=pre, pool=pool,
                     check=check, vb=vb, gap=gap, drift=-1 if drift is None else drift, db=db,
                     every=torch.sort(torch.cat([must, plan.cand_host])).values if drift is not None else None)

    # -- device side ------------------------------------------------------------------------------------
    def _rows(self, pool, inp: _Inputs, act: Tensor, nb: int) -> tuple[Tensor, Tensor]:
        """(rows [N]: pool row of each key with the active rows' scratch rows; dst [A]: where they write)."""
        valid = act >= 0
        trash = pool.scratch_start + pool.scratch_rows - 1
        dst = torch.where(valid, pool.scratch_start + act, trash)
        ext = inp.base.clone()
        ext[torch.where(valid, act, nb)] = dst
        return ext[:nb], dst

    def _select(self, h: _Host, inp: _Inputs, strategy, ratio: float, pool):
        """Probe kind: the question over the re-positioned cache, scores, top-K -> [K] chosen (-1 padded); with
        `h.gap`, (chosen, [1] the top-2 gap of the last prompt row's logits): the probe then runs on to the last
        layer, so that row's logits are the prompt's over the cached documents with nothing recomputed (reuse's)."""
        dec, spec = self.dec, self.spec
        cos, sin = self.runner._cos, self.runner._sin
        layers = strategy.probe_layers(spec.n_layers)
        kv_pos = torch.arange(h.nb, device=inp.buf.device)
        act = inp.must
        valid = act >= 0
        cand = inp.cand > 0
        rows, dst = self._rows(pool, inp, act, h.nb)
        if h.vb:  # the probed rows attend to the view only; padded keys sit past every query (position N)
            seen = inp.view >= 0
            view_rows = torch.where(seen, rows[inp.view.clamp_min(0)], rows[0])
            view_pos = torch.where(seen, inp.view, h.nb)
        else:
            view_rows, view_pos = rows, None  # slot p is position p (the kernels compute it)
        rope = (cos[act], sin[act])
        x = dec.embed_tokens(inp.ids[act.clamp_min(0)])
        probes = {}
        deepest = spec.n_layers - 1 if h.gap else max(layers)
        for i in range(deepest + 1):
            kp, vp = pool.k[i], pool.v[i]
            q, k, v = dec.project(i, x)
            scatter_rows(kp, dst, k)
            scatter_rows(vp, dst, v)
            qr = apply_rope(q, *rope)
            goes_on = i < max(layers) or h.gap
            if i in layers and goes_on and not h.vb:  # one key set: the scores reuse the attention's statistics
                o, att = attention_and_scores(qr, act, kp, vp, rows, None, cos, sin, spec.scale)
                probes[i] = torch.where(valid[:, None] & cand[None, :], att, 0.0)   # [M, N]
                x = dec.finish(i, x, o)
                continue
            if i in layers:
                att = attention_scores(qr, act, kp, rows, None, cos, sin, spec.scale)   # [M, N]
                probes[i] = torch.where(valid[:, None] & cand[None, :], att, 0.0)
            if goes_on:
                x = dec.finish(i, x, fused_attention(qr, act, kp, vp, view_rows, view_pos, cos, sin, spec.scale))
        own = valid & (act >= inp.scalars[2]) & (act < inp.scalars[3])
        ctx = SelectContext(n_layers=spec.n_layers, ratio=ratio, candidates=kv_pos, doc_spans=[], question=act,
                            question_attention=probes, probe_rows=own)
        chosen = self._top(strategy.scores(ctx), cand, inp, h.kb)
        if not h.gap:
            return chosen
        last = (valid.sum() - 1).view(1)  # the last prompt row: the last real probed row (padding sorts last)
        return chosen, first_token_gap(dec, x.index_select(0, last))

    @staticmethod
    def _top(scores: Tensor, cand: Tensor, inp: _Inputs, kb: int) -> Tensor:
        """[K] positions of the top-K candidate scores, ranks past the request's k set to -1."""
        scores = torch.where(cand, scores.float(), float("-inf"))
        top = torch.topk(scores, kb, sorted=True).indices
        keep = torch.arange(kb, device=scores.device) < inp.scalars[0]
        return torch.where(keep, top, -1)

    def _main(self, h: _Host, inp: _Inputs, chosen: Tensor | None, strategy, pool):
        """The fused layer loop -> (logits [vocab] fp32, per-layer (k, v), final active [A_b], recomputed [K_b])."""
        dec, spec = self.dec, self.spec
        cos, sin = self.runner._cos, self.runner._sin
        dev = inp.buf.device
        kv_pos = torch.arange(h.nb, device=dev)
        fresh = []
        last = spec.n_layers - 1
        if h.kind == "plain":
            x = dec.embed_tokens(inp.ids)
            c, s_ = cos[:h.nb], sin[:h.nb]
            end = inp.scalars[1:2]  # [1] the last prompt row: the only hidden state read after the last layer
            for i in range(spec.n_layers):
                q, k, v = dec.project(i, x)
                fresh.append((k, v))
                kr = apply_rope(k, c, s_)
                if i < last:
                    x = dec.finish(i, x, causal_attention(apply_rope(q, c, s_), kr, v, spec.scale))
                else:  # the last layer's attention, output projection and MLP for that row alone
                    qr = apply_rope(q.index_select(0, end), cos[end], sin[end])
                    x = dec.finish(i, x.index_select(0, end),
                                   fused_attention(qr, end, kr, v, None, None, None, None, spec.scale))
            logits = dec.logits(x)[0].float()
            return logits, fresh, kv_pos, None
        cand = inp.cand > 0
        check = h.check
        if h.kind == "check":
            act = inp.pre
        else:
            act = _real_first(torch.cat([inp.must, chosen]))
        rows, dst = self._rows(pool, inp, act, h.nb)
        drift = _BucketDrift(strategy.drift, h, inp, pool) if h.drift >= 0 else None
        x = dec.embed_tokens(inp.ids[act.clamp_min(0)])
        for i in range(spec.n_layers):
            kp, vp = pool.k[i], pool.v[i]
            q, k, v = dec.project(i, x)
            if i == check:  # slot p is position p here: score every slot, keep the top candidates
                score = strategy.refine_scores(k, kp.index_select(0, inp.base[:h.nb]))
                chosen = self._top(score, cand, inp, h.kb)
            if drift is not None and i >= h.drift:  # every candidate slot's corrected row, then the fresh ones
                drift.write(kp, vp, act, k, v)
            scatter_rows(kp, dst, k)  # the pool's scratch rows are this layer's fresh K/V (read at open)
            scatter_rows(vp, dst, v)
            if i == check:  # the kept rows go on; at this layer every key is still the fresh one just written
                act = _real_first(torch.cat([inp.must, chosen]))
                sel = act.clamp_min(0)
                q, x = q.index_select(0, sel), x.index_select(0, sel)
            qa, xa = q, x
            pos = act
            if i == last:  # only the last prompt row's hidden state is read (its logits): attend and finish it alone
                end = inp.scalars[1:2]
                qa, xa, pos = q.index_select(0, end), x.index_select(0, end), act.index_select(0, end)
            qr = apply_rope(qa, cos[pos], sin[pos])
            if i == h.drift:  # from here on the rows no longer change (a check layer comes before)
                rows = drift.rows(rows)
            x = dec.finish(i, xa, fused_attention(qr, pos, kp, vp, rows, None, cos, sin, spec.scale))
            if i == check:
                rows, dst = self._rows(pool, inp, act, h.nb)
        logits = dec.logits(x)[0].float()
        return logits, fresh, act, _real_first(chosen)

    def _body(self, h: _Host, inp: _Inputs, strategy, ratio: float, pool, part: str):
        if part == "select":
            return self._select(h, inp, strategy, ratio, pool)
        chosen = inp.chosen if h.kind in ("host", "probe") else None
        return self._main(h, inp, chosen, strategy, pool)

    def reset(self) -> None:
        """Drops every captured bucket and starts a new memory pool (the old one is freed with its last graph)."""
        self.entries.clear()
        self.sizes.clear()
        self.seen.clear()
        self.backlog.clear()
        if self.graphs:
            self.pool = torch.cuda.graph_pool_handle()

    # -- one request ------------------------------------------------------------------------------------
    def run(self, h: _Host, strategy, ratio: float, clock, probe_guard: float | None = None):
        """Runs the request's bucket (replayed, captured, or eagerly) -> (logits, pending, recomputed).

        `probe_guard` (a bucket planned with `probe_gap`): after the probe, its first-token gap is read on the host
        and, below this many nats, ProbeGuardTripped is raised before the fused pass runs."""
        dev = self.dec.device
        pool = h.pool
        entry = self.entries.get(h.key) if self.graphs else None
        if entry is None and self.graphs and h.key not in self.failed:
            self.seen[h.key] = self.seen.get(h.key, 0) + 1
            if self.seen[h.key] >= self.capture_after:
                if self.defer and h.key not in self.backlog:  # captured when the engine is idle; eager now
                    self.backlog[h.key] = (h, strategy, ratio)
                    while len(self.backlog) > MAX_CAPTURE_BACKLOG:  # never idle: the oldest wait longest
                        self.backlog.popitem(last=False)
                else:  # due, and not captured in idle time since: on this request's path
                    self.backlog.pop(h.key, None)
                    made = self._new_entry(h, strategy, ratio, pool, clock, probe_guard)
                    if made is not None and self.keep_warm:  # captured: the warm-up run computed this request
                        return made
                    entry = self.entries.get(h.key)
        if entry is not None:
            self.entries[h.key] = self.entries.pop(h.key)  # most recently used last
            inp, sel_graph, main_graph, out = entry
            inp.buf.copy_(h.packed, non_blocking=True)
            if sel_graph is not None:
                clock.start()
                sel_graph.replay()
                clock.stop()
                check_probe_guard(sel_graph.gap, probe_guard)
            main_graph.replay()
            self.replays += 1
            logits, fresh, act, recomputed = out
        else:
            self.eager_runs += 1
            inp = _Inputs(h.packed.to(dev, non_blocking=True), h.nb, h.mb, h.kb, h.vb)
            if h.kind == "probe":
                clock.start()
                got = self._body(h, inp, strategy, ratio, pool, "select")
                chosen, gap = got if h.gap else (got, None)
                inp.chosen.copy_(chosen)
                clock.stop()
                check_probe_guard(gap, probe_guard)
            logits, fresh, act, recomputed = self._body(h, inp, strategy, ratio, pool, "main")
        return self._outputs(h, inp, logits.clone(), fresh, act, recomputed)

    def capture_deferred(self) -> bool:
        """Captures the oldest bucket a request left due for capture (`defer`), on that request's inputs; False when
        none waits. For the engine's idle time only (the scheduler calls it, through `FusionEngine.build_deferred`,
        while no request is admitted or decoding): the capture's warm-up run writes the pool's scratch rows, which
        are one prefill's, and its outputs are dropped. The documents that request read may have been evicted
        since: their rows then hold other values, which changes only those dropped outputs (the graph records
        kernels, its inputs are data)."""
        while self.backlog:
            key, (h, strategy, ratio) = next(iter(self.backlog.items()))
            try:  # left in the backlog while it is captured, so `wait_for_deferred` waits for the graph
                if key in self.entries or key in self.failed:
                    continue
                self._new_entry(h, strategy, ratio, h.pool, None)
                return True
            finally:
                self.backlog.pop(key, None)
        return False

    def entry_bytes(self, kind: str, nb: int, mb: int, kb: int, vb: int = 0) -> int:
        """Bytes of a captured bucket's static outputs (what `max_bytes` bounds)."""
        spec = self.spec
        if kind == "plain":  # its per-layer K/V are the graph's outputs
            return nb * spec.n_layers * 2 * spec.n_kv_heads * spec.head_dim * self.dec.embed.element_size()
        # logits, index vectors and the static inputs only: the fresh K/V stay in the pool
        return spec.vocab * 4 + 8 * (nb + mb + kb + _Inputs.width(nb, mb, kb, vb))

    def make_room(self, size: int) -> list:
        """Drops the least recently used buckets until one more of `size` bytes fits both bounds; returns their
        keys. Their static outputs go back to the shared pool, where later captures reuse the memory (graphs are
        replayed one at a time, so buckets never run concurrently)."""
        dropped = []
        while self.entries and (len(self.entries) >= self.max_graphs
                                or sum(self.sizes.values()) + size > self.max_bytes):
            key = next(iter(self.entries))  # `run` moves a bucket to the end on every use
            del self.entries[key]
            self.sizes.pop(key, None)  # its sightings are kept: seen again, it is captured at once
            dropped.append(key)
        self.evictions += len(dropped)
        return dropped

    def _new_entry(self, h: _Host, strategy, ratio: float, pool, clock, probe_guard: float | None = None):
        """Captures the request's bucket and returns the request's outputs, computed by the capture's warm-up run
        (a capture records kernels without running them, so replaying the new graph as well would compute the
        request twice); None when the bucket cannot be captured (it then runs eagerly for good). A probe guard
        that trips raises ProbeGuardTripped after the selection graph's capture, before the fused pass is run or
        captured (the bucket is captured whole when next seen)."""
        size = self.entry_bytes(h.kind, h.nb, h.mb, h.kb, h.vb)
        self.make_room(size)
        try:
            inp = _Inputs(h.packed.to(self.dec.device), h.nb, h.mb, h.kb, h.vb)
            sel_graph = None
            if h.kind == "probe":
                # the selection time of a request answered from the warm-up is its warm-up's; one that replays
                # afterwards is timed at the replay
                sel_graph, got, warm = capture_graph_keeping_warm(
                    lambda: self._body(h, inp, strategy, ratio, pool, "select"), self.dec.device, self.pool,
                    clock if self.keep_warm else None)
                chosen, gap = got if h.gap else (got, None)
                warm_chosen, warm_gap = warm if h.gap else (warm, None)
                inp.chosen.copy_(warm_chosen)  # this request's selection, read by the fused pass's warm-up run
                # the select graph writes into the main graph's chosen input
                sel_graph = _Chained(sel_graph, chosen, inp.chosen, gap)
                check_probe_guard(warm_gap, probe_guard)
            main_graph, out, warm = capture_graph_keeping_warm(
                lambda: self._body(h, inp, strategy, ratio, pool, "main"), self.dec.device, self.pool)
        except ProbeGuardTripped:
            raise
        except Exception as exc:  # noqa: BLE001  (a bucket that cannot be captured runs eagerly for good)
            torch.cuda.synchronize()
            self.failed[h.key] = f"{type(exc).__name__}: {exc}"
            log.warning("bucket %s could not be captured (it runs eagerly): %s", h.key[:-1], self.failed[h.key])
            return None
        self.captures += 1
        self.entries[h.key] = (inp, sel_graph, main_graph, out)
        self.sizes[h.key] = size
        logits, fresh, act, recomputed = warm
        return self._outputs(h, inp, logits.clone(), fresh, act, recomputed)

    def _outputs(self, h: _Host, inp: _Inputs, logits, fresh, act, recomputed):
        """(logits, pending for Decoding.open, recomputed positions); views of `inp` and of graph outputs, read by
        the caller before the next prefill."""
        dev = self.dec.device
        n = h.n
        if h.kind == "plain":
            src = AssembledSource([], n, (self.spec.n_kv_heads, self.spec.head_dim), self.dec.dtype, dev)
            pos = torch.arange(n, device=dev)
            pending = [(pos, k[:n], v[:n]) for k, v in fresh]
            return logits, (src, pending, n), torch.arange(0)
        a = h.m + h.k
        final = act[:a]
        pending = []
        pre = h.pre.to(dev, non_blocking=True) if h.kind == "check" else None
        pool = h.pool
        # layer i wrote the rows it computed to their scratch rows (slot p = position p); up to the check layer
        # those are every candidate's
        late = PoolRows(pool, final + pool.scratch_start)
        early = PoolRows(pool, pre + pool.scratch_start) if pre is not None else None
        if h.drift >= 0:  # from the drift's first layer every candidate row is the request's own (its scratch row)
            every = h.every.to(dev, non_blocking=True)
            drifted = (every, PoolRows(pool, every + pool.scratch_start), None)
        for i in range(self.spec.n_layers):
            if h.drift >= 0 and i >= h.drift:
                pending.append(drifted)
                continue
            pending.append((pre, early, None) if i <= h.check else (final, late, None))
        scratch = torch.arange(pool.scratch_start, pool.scratch_start + n, device=dev)
        src = PooledSource.from_rows(pool, inp.base[:n], scratch)  # the request's rows, already on the device
        return logits, (src, pending, n), recomputed[:h.k]


class _BucketDrift:
    """The drift correction (kernels/drift.py) inside a bucket, over every slot: a non-candidate slot's destination is
    the trash row (the torch path writes it there, the Triton path skips it); the attention reads every candidate slot
    from its scratch row."""

    def __init__(self, alpha: float, h: _Host, inp: _Inputs, pool) -> None:
        nb = h.nb
        self.alpha, self.db = float(alpha), h.db
        self.base = inp.base[:nb]
        self.doc = inp.cand[:nb] - 1  # [N] document of each slot, -1 where it is not a candidate
        own = pool.scratch_start + torch.arange(nb, device=inp.buf.device)
        trash = pool.scratch_start + pool.scratch_rows - 1
        self.dst = torch.where(self.doc >= 0, own, trash)
        self._fresh = None  # (act, its cached rows, its documents): the same in every drift layer after the check

    def write(self, kp: Tensor, vp: Tensor, act: Tensor, k: Tensor, v: Tensor) -> None:
        if self._fresh is None or self._fresh[0] is not act:
            a = act.clamp_min(0)
            self._fresh = (act, self.base.index_select(0, a), torch.where(act >= 0, self.doc.index_select(0, a), -1))
        _, fresh_base, fresh_doc = self._fresh
        drift_correct(kp, vp, k, v, fresh_base, fresh_doc, self.base, self.doc, self.dst, self.db, self.alpha)

    def rows(self, rows: Tensor) -> Tensor:
        """The attention's row map in a drift layer: every candidate slot reads its scratch row."""
        return torch.where(self.doc >= 0, self.dst, rows)


class _Chained:
    """A selection graph whose output is copied into the main graph's input (`gap`: its probe's first-token gap
    output, when planned with one)."""

    def __init__(self, graph, out: Tensor, dst: Tensor, gap: Tensor | None = None) -> None:
        self.graph, self.out, self.dst, self.gap = graph, out, dst, gap

    def replay(self) -> None:
        self.graph.replay()
        self.dst.copy_(self.out)
