import json

import pytest
from fake_engine import ANSWERS, SIFT_DENSITY, FakeEngine

from kvfuse.evaluation.data import read_jsonl, smoke_data_path
from kvfuse.evaluation.runner import Config, EvalRunner, RecordStore, _offline_strategies, build_configs, record_key


@pytest.fixture
def examples():
    return read_jsonl(smoke_data_path())


class Factory:
    def __init__(self):
        self.engines = []

    def __call__(self):
        e = FakeEngine()
        self.engines.append(e)
        return e


def _runner(out, factory, **kw):
    kw.setdefault("progress", False)
    return EvalRunner(factory, out, model="fake", max_new_tokens=kw.pop("max_new_tokens", 8), **kw)


def test_build_configs():
    cfg = build_configs(["reuse", "cacheblend", "epic", "full"], [0.15, 0.3])
    assert cfg == [Config("full", 1.0), Config("reuse", 0.0), Config("cacheblend", 0.15), Config("cacheblend", 0.3),
                   Config("epic", 0.15), Config("epic", 0.3)]
    assert build_configs(["cacheblend"], [0.15])[0] == Config("full", 1.0)  # full always runs, first
    assert build_configs(["cacheblend", "cacheblend"], [0.15, 0.15]) == [Config("full", 1.0),
                                                                          Config("cacheblend", 0.15)]
    with pytest.raises(ValueError, match="unknown strategy 'nosuch'; available: .*cacheblend"):
        build_configs(["nosuch"], [0.15])
    # variants by spec run beside the plain strategy, each its own config (and resume key)
    assert build_configs(["infoflow", "infoflow:rows=all"], [0.15])[1:] == [Config("infoflow", 0.15),
                                                                           Config("infoflow:rows=all", 0.15)]
    for bad in ("infoflow:rows=sideways", "infoflow:nosuch=1", "infoflow:rows"):
        with pytest.raises(ValueError, match="--strategies"):
            build_configs([bad], [0.15])
    for bad in ([0.0], [1.5], [float("nan")], []):
        with pytest.raises(ValueError, match="ratio"):
            build_configs(["cacheblend"], bad)


def test_run_records_metrics_and_reuse_counts(tmp_path, examples):
    factory = Factory()
    configs = build_configs(["reuse", "cacheblend", "epic"], [0.15, 0.3])
    runner = _runner(tmp_path, factory, warmup=False)
    stats = runner.run(examples, configs)
    assert len(factory.engines) == 1
    assert stats.executed == stats.total == len(examples) * len(configs) and stats.skipped == 0
    recs = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(recs) == stats.total
    # per example, full comes first
    assert recs[0]["strategy"] == "full" and recs[len(configs)]["strategy"] == "full"
    by = {(r["example_id"], r["strategy"], r["ratio"]): r for r in recs}
    ex = examples[0]
    full = by[(ex.id, "full", 1.0)]
    assert full["fidelity"] == 1.0 and full["kl"] == pytest.approx(0.0, abs=1e-12)
    assert full["kl_selfcheck"] is True and full["greedy_agreement"] == 1.0
    assert full["answer"] == ANSWERS["full"] and full["token_ids"]
    reuse = by[(ex.id, "reuse", 0.0)]
    assert reuse["fidelity"] == pytest.approx(0.8)  # "alpha beta" vs "alpha beta gamma"
    assert reuse["recompute_fraction"] == 0.0 and reuse["kl"] > 0
    cb15, cb30 = by[(ex.id, "cacheblend", 0.15)], by[(ex.id, "cacheblend", 0.3)]
    assert cb15["fidelity"] == 1.0 and cb15["recompute_fraction"] == pytest.approx(0.15)
    assert cb15["kl"] > cb30["kl"] > 0  # the fake's noise shrinks with the ratio
    assert by[(ex.id, "epic", 0.15)]["fidelity"] == 0.0
    assert all(r["metric"] == "f1" and 0 <= r["score"] <= 1 for r in recs)
    assert recs[0]["gold"] == list(ex.answers)
    # KL is teacher forced over the full answer's tokens
    eng = factory.engines[0]
    assert all(r["kl_tokens"] == len(full["token_ids"]) for r in recs if r["example_id"] == ex.id)
    # self-check on the first two examples only
    assert len(stats.selfcheck) == 2
    assert "kl_selfcheck" not in by[(examples[2].id, "full", 1.0)]
    # every passage precomputed; shared ones served from the cache
    slots = sum(len(e.passages) for e in examples)
    distinct = len({pid for e in examples for pid, _ in e.docs})
    assert stats.passage_slots == slots and stats.distinct_passages == distinct
    assert stats.precompute_misses == distinct and stats.precompute_hits == slots - distinct > 0
    assert sum(1 for c in eng.calls if c[0] == "generate" and c[2] == "full") == len(examples)
    assert "served" in stats.describe()


def test_resume_skips_done_and_never_loads_engine(tmp_path, examples):
    configs = build_configs(["reuse", "cacheblend"], [0.15])
    _runner(tmp_path, Factory(), warmup=False).run(examples, configs)
    factory = Factory()
    stats = _runner(tmp_path, factory).run(examples, configs)
    assert stats.executed == 0 and stats.skipped == stats.total
    assert factory.engines == []
    # another token budget is another key: everything runs again
    stats = _runner(tmp_path, factory, max_new_tokens=4, warmup=False).run(examples, configs)
    assert stats.executed == stats.total


def test_partial_resume_uses_stored_full_answer_and_survives_a_torn_line(tmp_path, examples):
    configs = build_configs(["reuse", "cacheblend"], [0.15])
    _runner(tmp_path, Factory(), warmup=False).run(examples, configs)
    path = tmp_path / "records.jsonl"
    lines = path.read_text().splitlines()
    kept = [l for l in lines if json.loads(l)["strategy"] == "full"]
    path.write_text("\n".join(kept) + "\n" + lines[1][: len(lines[1]) // 2])  # killed mid-write
    assert RecordStore(tmp_path).bad_lines == 1
    factory = Factory()
    stats = _runner(tmp_path, factory, warmup=False).run(examples, configs)
    assert stats.executed == len(examples) * 2 and stats.skipped == len(examples)
    eng = factory.engines[0]
    assert not any(c[0] == "generate" and c[2] == "full" for c in eng.calls)  # full answer read back
    assert any(c[0] == "logprobs" and c[2] == "full" for c in eng.calls)  # reference re-derived for KL
    store = RecordStore(tmp_path)
    assert store.bad_lines == 1
    for ex in examples:
        for c in configs:
            rec = store.get(record_key(ex.id, c.strategy, c.ratio, "fake", 8))
            assert rec is not None and rec["kl"] is not None
    # the appended records start on a fresh line
    for line in path.read_text().splitlines()[len(kept) + 1:]:
        json.loads(line)


def test_engine_errors_name_the_config(tmp_path, examples):
    runner = _runner(tmp_path, Factory(), warmup=False)
    with pytest.raises(ValueError, match="nosuch@0.15 on 2wikimqa-.*unknown strategy"):
        runner.run(examples[:1], [Config("full", 1.0), Config("nosuch", 0.15)])
    # the full reference written before the failure is kept
    assert RecordStore(tmp_path).get(record_key(examples[0].id, "full", 1.0, "fake", 8)) is not None


def test_warmup_runs_each_strategy_once_before_timing(tmp_path, examples):
    factory = Factory()
    _runner(tmp_path, factory).run(examples[:1], build_configs(["reuse", "cacheblend"], [0.15, 0.3]))
    calls = [c for c in factory.engines[0].calls if c[0] == "generate"]
    assert [c[2] for c in calls[:3]] == ["full", "reuse", "cacheblend"] and calls[0][1] == "Say OK."


def test_one_prefill_per_run_scores_kl_from_the_generation(tmp_path, examples):
    """KL comes from the generation's own prefill (teacher_ids / return_logprobs): the only separate
    teacher-forced passes are the reference self-checks, and the KL equals what such a pass gives."""
    factory = Factory()
    configs = build_configs(["reuse", "cacheblend"], [0.15])
    _runner(tmp_path, factory, warmup=False, selfcheck_examples=1).run(examples, configs)
    eng = factory.engines[0]
    assert [c for c in eng.calls if c[0] == "logprobs"] == [("logprobs", examples[0].question, "full", 1.0)]
    assert sum(c[0] == "generate" for c in eng.calls) == len(examples) * len(configs)
    rec = RecordStore(tmp_path).get(record_key(examples[1].id, "reuse", 0.0, "fake", 8))
    ref = RecordStore(tmp_path).get(record_key(examples[1].id, "full", 1.0, "fake", 8))
    from kvfuse.evaluation.metrics import mean_kl
    ex = examples[1]
    want = mean_kl(FakeEngine().next_token_logprobs(ex.question, ex.docs, ref["token_ids"], "full", 1.0),
                   FakeEngine().next_token_logprobs(ex.question, ex.docs, ref["token_ids"], "reuse", 0.0))
    assert rec["kl"] == pytest.approx(want) and rec["kl"] > 0


def test_offline_work_of_strategies_is_precomputed_outside_requests():
    configs = build_configs(["reuse", "cacheblend", "qcfuse", "fusionrag", "infoflow", "sift"], [0.15])
    assert _offline_strategies(configs) == ["qcfuse", "fusionrag", "sift"]  # sift: its indexes, like caches


def test_prompt_preset_is_recorded_and_keys_the_resume(tmp_path, examples):
    configs = build_configs(["reuse"], [0.15])
    _runner(tmp_path, Factory(), warmup=False, prompt="chat").run(examples, configs)
    assert {r["prompt"] for r in RecordStore(tmp_path).all()} == {"chat"}
    stats = _runner(tmp_path, Factory(), warmup=False).run(examples, configs)  # qa: nothing of chat is reused
    assert stats.executed == stats.total and stats.skipped == 0
    assert _runner(tmp_path, Factory(), warmup=False, prompt="chat").run(examples, configs).executed == 0


def test_load_engine_rejects_an_unknown_prompt():
    from kvfuse.evaluation.runner import load_engine

    with pytest.raises(ValueError, match="unknown prompt 'poem'; available: chat, qa"):
        load_engine("smollm2-135m", prompt="poem")


def test_attach_corpus_groups_each_examples_passages(examples):
    import torch

    from kvfuse.evaluation.runner import attach_corpus

    def embed(texts):  # letter counts: similar texts get similar vectors
        return torch.tensor([[t.lower().count(c) + 1e-3 for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts])

    eng = attach_corpus(FakeEngine(), examples, embed=embed)
    assert len(eng.corpus) == len({text for e in examples for _, text in e.docs})
    every = {text for e in examples for _, text in e.docs}
    with_neighbours = 0
    for ex in examples:
        for pid, text in ex.docs:
            banned = {t for e in examples if text in {x for _, x in e.docs} for _, t in e.docs}
            found = {d.text for d in eng.corpus.neighbours((pid, text), 5)}
            assert not found & banned  # never a passage it was retrieved with, in any example
            assert bool(found) == bool(every - banned)
            with_neighbours += bool(found)
    assert with_neighbours > 0


def test_requested_dtype_keys_the_resume(tmp_path, examples):
    configs = build_configs(["reuse"], [0.15])
    _runner(tmp_path, Factory(), warmup=False).run(examples, configs)
    fp32 = _runner(tmp_path, Factory(), warmup=False, extra={"dtype": "float32"})
    stats = fp32.run(examples, configs)  # the default-dtype records are not served to an fp32 run
    assert stats.executed == stats.total and stats.skipped == 0
    assert {r.get("dtype") for r in RecordStore(tmp_path).all()} == {None, "float32"}
    again = _runner(tmp_path, Factory(), warmup=False, extra={"dtype": "torch.float32"}).run(examples, configs)
    assert again.executed == 0 and again.skipped == again.total
    assert record_key("e", "full", 1.0, "m", 8) != record_key("e", "full", 1.0, "m", 8, dtype="float32")


def test_sift_records_its_attention_density(tmp_path, examples):
    """A sift run's density (its speed's driver) is on its record, so a marks sweep reads quality beside it."""
    _runner(tmp_path, Factory(), warmup=False).run(examples, build_configs(["sift", "reuse"], [0.15]))
    recs = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert {r["sift_density"] for r in recs if r["strategy"] == "sift"} == {SIFT_DENSITY}
    assert all("sift_density" not in r for r in recs if r["strategy"] != "sift")


def test_build_configs_with_guards():
    cfg = build_configs(["reuse", "infoflow"], [0.15], guards=[0.5, 2])
    assert [c.label for c in cfg] == ["full", "reuse", "reuse+guard0.5", "reuse+guard2", "infoflow@0.15",
                                      "infoflow@0.15+guard0.5", "infoflow@0.15+guard2"]
    with pytest.raises(ValueError, match="--guard"):
        build_configs(["reuse"], [0.15], guards=[0])
    assert [c.label for c in build_configs(["reuse"], [0.15], guards=[0.5], guard_tokens=1)] == [
        "full", "reuse", "reuse+guard0.5/1"]


def test_probe_guards_go_to_the_strategies_that_probe():
    cfg = build_configs(["reuse", "cacheblend", "infoflow", "prophetkv"], [0.15], guards=[1], guard_at="probe")
    assert [c.label for c in cfg] == ["full", "reuse", "cacheblend@0.15", "infoflow@0.15", "infoflow@0.15+probeguard1",
                                      "prophetkv@0.15", "prophetkv@0.15+probeguard1"]
    assert {c.guard_at for c in cfg if c.guard} == {"probe"} and all(c.guard_tokens is None for c in cfg)


def test_a_probe_guarded_run_is_recorded_beside_the_plain_one(tmp_path, examples, tiny_engine):
    """A probe guard above every gap: each answer is full prefill's, recorded as handed over at the first token with
    every document token recomputed; below every gap, the fused answer."""
    runner = _runner(tmp_path, lambda: tiny_engine("qwen2"), max_new_tokens=4, warmup=False)
    runner.run(examples[:2], build_configs(["infoflow"], [0.15], guards=[1e9, 1e-9], guard_at="probe"))
    recs = {(r["example_id"], r["strategy"]): r for r in runner.store.all()}
    for ex in examples[:2]:
        full, plain = recs[(ex.id, "full")], recs[(ex.id, "infoflow")]
        high, low = recs[(ex.id, "infoflow+probeguard1e+09")], recs[(ex.id, "infoflow+probeguard1e-09")]
        assert high["token_ids"] == full["token_ids"] and high["recompute_fraction"] == 1.0
        assert high["guard_escalated_at"] == 0 and high["guard_at"] == "probe"
        assert low["guard_escalated_at"] is None and low["token_ids"] == plain["token_ids"]


def test_a_guarded_run_is_recorded_with_where_it_escalated(tmp_path, examples, tiny_engine):
    """With the real engine (a tiny model): a guard above every margin makes each answer full prefill's, and the
    record says so (escalated at the first token, every document token recomputed)."""
    runner = _runner(tmp_path, lambda: tiny_engine("qwen2"), max_new_tokens=4, warmup=False)
    runner.run(examples[:2], build_configs(["cacheblend"], [0.15], guards=[1e9, 1e-9]))
    recs = {(r["example_id"], r["strategy"]): r for r in runner.store.all()}
    for ex in examples[:2]:
        full = recs[(ex.id, "full")]
        high = recs[(ex.id, "cacheblend+guard1e+09")]
        assert high["token_ids"] == full["token_ids"] and high["fidelity"] == 1.0
        assert high["guard_escalated_at"] == 0 and high["recompute_fraction"] == 1.0
        low, plain = recs[(ex.id, "cacheblend+guard1e-09")], recs[(ex.id, "cacheblend")]
        assert low["guard_escalated_at"] is None and low["token_ids"] == plain["token_ids"]
        assert plain["recompute_fraction"] < 1.0 and "guard_margin" not in plain


def test_attach_pool_fills_it_from_other_examples_never_the_evaluated_ones(examples):
    from types import SimpleNamespace

    from kvfuse.engine.corpus import DocumentPool
    from kvfuse.evaluation.runner import attach_pool

    import dataclasses

    evaluated = examples[:1]
    shared = examples[0].passages[0]  # a passage of an evaluated question, retrieved for another one too
    others = [dataclasses.replace(examples[1], dataset="a", passages=(shared,) + examples[1].passages),
              dataclasses.replace(examples[2], dataset="b")]
    texts = {text for e in others for _, text in e.docs} - {text for e in evaluated for _, text in e.docs}
    eng = SimpleNamespace(doc_cache=SimpleNamespace(pool=DocumentPool(capacity=6)))
    attach_pool(eng, others, exclude=evaluated)
    pool = eng.doc_cache.pool
    members = [d for d in pool._docs.values()]
    assert len(members) == min(6, len(texts)) and pool.full == (len(texts) >= 6)
    assert {d.text for d in members} <= texts  # only other examples' passages, none shared with the evaluated
    sets = {e.dataset for e in others for _, text in e.docs if text in {d.text for d in members}}
    assert len(sets) >= 2  # taken from each dataset in turn
    big = SimpleNamespace(doc_cache=SimpleNamespace(pool=DocumentPool(capacity=10_000)))
    attach_pool(big, examples, exclude=examples)
    assert len(big.doc_cache.pool) == 0  # everything evaluated: nothing to put in
