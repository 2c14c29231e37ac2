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
