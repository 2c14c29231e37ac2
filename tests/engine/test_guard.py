"""The guard (GenerationOptions.guard_margin): a near-tie on the fused path hands the answer to full prefill.

Escalated at the first token, the answer is full prefill's token for token; escalated mid-answer, the tokens before
are the fused path's and every token from there is full prefill's next token given the answer so far (checked
against full prefill's own teacher-forced scores); below every margin it changes nothing."""
from __future__ import annotations

import threading

import pytest
import torch
from cases import DOCS, QUESTION, guard_margins, mid_answer_departure

from kvfuse.engine.config import EngineConfig
from kvfuse.engine.options import GenerationOptions

N = 8


@pytest.fixture
def engine(tiny_engine):
    eng = tiny_engine("qwen2")
    eng.precompute(DOCS)
    return eng


def test_a_guard_above_every_margin_answers_by_full_prefill(engine):
    full = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=N, return_logprobs=True)
    r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=N, guard_margin=1e9, return_logprobs=True)
    assert r.token_ids == full.token_ids and r.text == full.text
    assert r.strategy == "full" and r.recomputed_tokens == r.doc_tokens
    g = r.extra["guard"]
    assert g["requested"] == "reuse" and g["escalated_at"] == 0 and g["margin_nats"] == 1e9
    assert torch.allclose(r.extra["logprobs"], full.extra["logprobs"], atol=1e-4)


def test_a_guard_below_every_margin_changes_nothing(engine):
    plain = engine.generate(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=N,
                            return_logprobs=True)
    low = min(guard_margins(plain.extra["logprobs"]))
    r = engine.generate(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=N,
                        guard_margin=low / 2 if low > 0 else 1e-12)
    assert r.token_ids == plain.token_ids and r.strategy == "cacheblend" and "guard" not in r.extra


def test_mid_answer_escalation_continues_as_full_prefill_would(engine):
    strategy, q, guard, t, fused = mid_answer_departure(engine, N)
    r = engine.generate(q, DOCS, strategy=strategy, recompute_ratio=0.15, max_new_tokens=N, guard_margin=guard,
                        return_logprobs=True)
    g = r.extra["guard"]
    assert g["escalated_at"] == t and g["requested"] == strategy and r.strategy == "full"
    assert r.token_ids[:t] == fused.token_ids[:t]  # the fused path's confident tokens stay
    assert r.token_ids[t] != fused.token_ids[t]  # where it departed from full prefill, full's token
    scored = engine.generate(q, DOCS, strategy="full", max_new_tokens=1, teacher_ids=r.token_ids)
    full_lp = scored.extra["teacher_logprobs"]
    assert r.token_ids[t:] == full_lp[t:].argmax(-1).tolist()[:len(r.token_ids) - t]  # full's greedy from t on
    # the answer's log-probs are re-scored under the path that served it: full prefill's
    assert torch.allclose(r.extra["logprobs"], full_lp[:len(r.token_ids)], atol=1e-4)


def test_an_escalating_request_does_not_disturb_the_batch(engine):
    strategy, q, guard, t, _ = mid_answer_departure(engine, N)
    solo_other = engine.generate(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=N)
    solo_guarded = engine.generate(q, DOCS, strategy=strategy, recompute_ratio=0.15, max_new_tokens=N,
                                   guard_margin=guard)
    streams = [engine.stream(q, DOCS, strategy=strategy, recompute_ratio=0.15, max_new_tokens=N, guard_margin=guard),
               engine.stream(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=N)]
    results = [None, None]

    def read(i):
        for _ in streams[i]:
            pass
        results[i] = streams[i].result

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert results[0].token_ids == solo_guarded.token_ids and results[0].extra["guard"]["escalated_at"] == t
    assert results[1].token_ids == solo_other.token_ids and "guard" not in results[1].extra


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "1", True])
def test_a_bad_guard_is_refused_before_any_work(bad):
    with pytest.raises(ValueError, match="guard_margin"):
        GenerationOptions(guard_margin=bad)
    with pytest.raises(ValueError, match="guard_margin"):
        EngineConfig(guard_margin=bad)


def test_the_engine_default_guards_every_request_that_sets_none(tiny_engine):
    engine = tiny_engine("qwen2", guard_margin=1e9)
    engine.precompute(DOCS)
    full = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=N)
    r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=N)
    assert r.token_ids == full.token_ids and r.extra["guard"]["margin_nats"] == 1e9
    off = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=N, guard_margin=0)
    assert off.strategy == "reuse" and "guard" not in off.extra
    with pytest.raises(ValueError, match="guard_tokens"):
        EngineConfig(guard_tokens=0)


def test_full_prefill_is_never_guarded(engine):
    r = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=N, guard_margin=1e9)
    assert r.strategy == "full" and "guard" not in r.extra


def test_a_failed_hand_over_fails_that_request_alone_and_leaks_nothing(engine, monkeypatch):
    from kvfuse.engine import scheduler

    strategy, q, guard, t, _ = mid_answer_departure(engine, N)
    real = scheduler.Request._prefill

    def broken(self, decoding, doc_ids, first):
        if not first:
            raise RuntimeError("the full prefill failed")
        return real(self, decoding, doc_ids, first)

    monkeypatch.setattr(scheduler.Request, "_prefill", broken)
    free_before = engine.decoding.arena.pool.free_rows
    with pytest.raises(RuntimeError, match="the full prefill failed"):
        engine.generate(q, DOCS, strategy=strategy, recompute_ratio=0.15, max_new_tokens=N, guard_margin=guard)
    assert not engine.store.memory.pins  # every pin given back
    assert engine.decoding.arena.pool.free_rows == free_before  # and every arena row
    monkeypatch.undo()
    ok = engine.generate(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=N)
    assert ok.strategy == "cacheblend" and len(ok.token_ids) > 0  # the engine goes on serving


def test_guard_tokens_limits_the_check_to_the_answers_first_tokens(engine):
    strategy, q, guard, t, fused = mid_answer_departure(engine, N)
    kw = dict(strategy=strategy, recompute_ratio=0.15, max_new_tokens=N, guard_margin=guard)
    early = engine.generate(q, DOCS, guard_tokens=t, **kw)  # tokens 0..t-1 checked: none below the margin
    assert early.token_ids == fused.token_ids and early.strategy == strategy and "guard" not in early.extra
    late = engine.generate(q, DOCS, guard_tokens=t + 1, **kw)
    assert late.extra["guard"]["escalated_at"] == t and late.token_ids[t] != fused.token_ids[t]
    first = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=N, guard_margin=1e9, guard_tokens=1)
    assert first.extra["guard"]["escalated_at"] == 0  # the first token is always checked


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_guard_tokens_is_refused(bad):
    with pytest.raises(ValueError, match="guard_tokens"):
        GenerationOptions(guard_margin=0.5, guard_tokens=bad)


# -- guard_at="probe": the question probe's first-token gap, read before the fused prefill -------------------------

def _reuse_gap(eng) -> float:
    r = eng.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=1, return_logprobs=True)
    top = r.extra["logprobs"][0].float().topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("path", ["runner", "bucketed"])
@pytest.mark.parametrize("strategy", ["infoflow", "prophetkv"])
def test_the_probe_guard_reads_reuses_gap_and_hands_over_before_the_fused_pass(tiny_engine, monkeypatch, path,
                                                                                strategy):
    """The probe of a query-aware strategy, run on to the last layer, gives the prompt's first token over the cached
    documents with nothing recomputed: reuse's. Just above that gap the request is full prefill's, token for token,
    and the fused pass never runs; just below, the fused answer is untouched."""
    from kvfuse.engine.bucketed import LayoutGraphs
    from kvfuse.engine.runner import Runner

    # the bucketed path (CUDA's first-sight one, eager on the CPU) reads the pooled tier
    eng = tiny_engine("qwen2", kv_tier="pool", bucketed_prefill=path == "bucketed")
    eng.precompute(DOCS)
    full = eng.generate(QUESTION, DOCS, strategy="full", max_new_tokens=N)
    plain = eng.generate(QUESTION, DOCS, strategy=strategy, recompute_ratio=0.3, max_new_tokens=N)
    gap = _reuse_gap(eng)
    fused_passes = []
    layers, main = Runner._layers, LayoutGraphs._main
    monkeypatch.setattr(Runner, "_layers", lambda self, *a, **k: (  # a[1]: cached segments (none for full)
        fused_passes.append("runner") if a[1] and not k.get("probe_layers") else None, layers(self, *a, **k))[1])
    monkeypatch.setattr(LayoutGraphs, "_main", lambda self, *a, **k: (  # a[0]: the bucket ("plain": full)
        fused_passes.append("bucketed") if a[0].kind != "plain" else None, main(self, *a, **k))[1])
    over = eng.generate(QUESTION, DOCS, strategy=strategy, recompute_ratio=0.3, max_new_tokens=N,
                        guard_margin=gap + 1e-3, guard_at="probe")
    assert over.strategy == "full" and over.token_ids == full.token_ids
    g = over.extra["guard"]
    assert g["at"] == "probe" and g["requested"] == strategy and g["escalated_at"] == 0
    assert g["margin"] == pytest.approx(gap, abs=1e-3)
    assert fused_passes.count(path) == 0  # no fused pass ran (the probe and full prefill's plain pass did)
    under = eng.generate(QUESTION, DOCS, strategy=strategy, recompute_ratio=0.3, max_new_tokens=N,
                         guard_margin=gap - 1e-3, guard_at="probe")
    assert under.strategy == strategy and under.token_ids == plain.token_ids and "guard" not in under.extra
    assert fused_passes == [path]


def test_the_probe_guard_checks_no_answer_token(engine, monkeypatch):
    """guard_at="probe" reads the probe alone: a margin below the probe's gap leaves even a near-tie mid-answer
    alone (the answer guard would hand it over there)."""
    gap = _reuse_gap(engine)
    r = engine.generate(QUESTION, DOCS, strategy="infoflow", recompute_ratio=0.3, max_new_tokens=N,
                        guard_margin=gap - 1e-3, guard_at="probe", return_logprobs=True)
    assert "guard" not in r.extra and r.strategy == "infoflow"
    assert min(guard_margins(r.extra["logprobs"])) < gap - 1e-3  # the answer has a token below the margin


def test_the_engine_default_guard_at_applies_and_a_request_overrides_it(tiny_engine):
    eng = tiny_engine("qwen2", guard_margin=1e9, guard_at="probe")
    eng.precompute(DOCS)
    r = eng.generate(QUESTION, DOCS, strategy="prophetkv", recompute_ratio=0.3, max_new_tokens=N)
    assert r.strategy == "full" and r.extra["guard"]["at"] == "probe"
    a = eng.generate(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=N,
                     guard_at="answer")
    assert a.strategy == "full" and a.extra["guard"]["at"] == "answer"


@pytest.mark.parametrize("kwargs,message", [
    (dict(strategy="cacheblend", guard_margin=1.0, guard_at="probe"), "runs none"),
    (dict(strategy="reuse", guard_margin=1.0, guard_at="probe"), "runs none"),
    (dict(strategy="infoflow", guard_margin=1.0, guard_at="before"), "guard_at must be one of"),
    (dict(strategy="infoflow", guard_margin=1.0, guard_at="probe", guard_tokens=1), "no guard_tokens"),
])
def test_a_bad_probe_guard_is_refused_before_any_work(engine, kwargs, message):
    before = engine.serving_stats()["requests_done"]
    with pytest.raises(ValueError, match=message):
        engine.generate(QUESTION, DOCS, max_new_tokens=2, **kwargs)
    assert engine.serving_stats()["requests_done"] == before
    with pytest.raises(ValueError, match="guard_at must be one of"):
        EngineConfig(guard_at="first")
