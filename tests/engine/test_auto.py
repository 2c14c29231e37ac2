"""strategy="auto": choices from a measured front, fronts as validated JSON, and the engine serving the choice."""
from __future__ import annotations

import json

import pytest
import torch
from cases import DOCS, QUESTION

from kvfuse.engine.auto import Front, FrontPoint, TtftRate, build_front, packaged_front, rel_ttft_from
from kvfuse.engine.options import GenerationOptions

POINTS = (FrontPoint("reuse", 0.0, 0.45, 0.41, {"cpu": 0.1, "cuda": 0.25}),
          FrontPoint("cacheblend", 0.15, 0.55, 0.3, {"cpu": 0.35, "cuda": 0.57}),
          FrontPoint("infoflow", 0.15, 0.67, 0.14, {"cpu": 0.43, "cuda": 0.58}),
          FrontPoint("infoflow", 0.3, 0.80, 0.08, {"cpu": 0.6}))  # not measured on cuda: unusable there


def front(adapter: str = "") -> Front:
    return Front("m", adapter, POINTS, ("infoflow", 0.15), "test")


def test_a_fidelity_target_takes_the_fastest_point_meeting_it():
    f = front()
    assert (f.choose("cpu", target_fidelity=0.5).strategy, f.choose("cpu", target_fidelity=0.5).ratio) == (
        "cacheblend", 0.15)
    c = f.choose("cpu", target_fidelity=0.7)
    assert (c.strategy, c.ratio) == ("infoflow", 0.3)
    assert f.choose("cuda", target_fidelity=0.7).strategy == "full"  # the 0.3 point has no cuda TTFT
    assert f.choose("cpu", target_fidelity=0.95).strategy == "full"
    assert f.choose("cpu", target_fidelity=0.1).strategy == "reuse"


def test_a_budget_takes_the_most_faithful_point_predicted_within_it():
    f = front()
    c = f.choose("cpu", ttft_budget_s=0.5, full_ttft_s=1.0)  # within 0.5: reuse, cacheblend, infoflow@15%
    assert (c.strategy, c.ratio, c.budget_met) == ("infoflow", 0.15, True)
    assert c.predicted_ttft_s == pytest.approx(0.43)
    assert f.choose("cpu", ttft_budget_s=2.0, full_ttft_s=1.0).strategy == "full"
    c = f.choose("cpu", ttft_budget_s=0.01, full_ttft_s=1.0)  # nothing fits: the fastest, flagged
    assert (c.strategy, c.budget_met) == ("reuse", False)
    with pytest.raises(ValueError, match="estimate"):
        f.choose("cpu", ttft_budget_s=1.0)
    d = f.choose("cpu")
    assert (d.strategy, d.ratio) == ("infoflow", 0.15)


def test_fronts_are_validated_json_that_round_trips(tmp_path):
    f = front("abcd")
    p = f.save(tmp_path / "f.json")
    g = Front.load(p)
    assert g == f and g.points[0].strategy == "full"
    data = json.loads(p.read_text())
    data["points"][0]["fidelity"] = 1.5
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="fidelity"):
        Front.load(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_bytes(b"\x80\x04\x95 not json")  # e.g. a pickle: refused, never loaded
    with pytest.raises(ValueError, match="JSON"):
        Front.load(tmp_path / "junk.json")
    data = json.loads(p.read_text())
    data["default"] = {"strategy": "epic", "ratio": 0.15}
    with pytest.raises(ValueError, match="default"):
        Front.from_json(data)


def test_a_front_is_built_from_an_eval_summary_and_a_ttft_csv(tmp_path):
    head = "dataset,strategy,ratio,n,metric,score,score_lo,score_hi,rel_full_pct,fidelity,fidelity_lo,fidelity_hi,kl,ttft_s\n"
    rows = ["a,full,1.0,5,f1,.4,0,1,100,1.0,1,1,0.0,2.0", "a,infoflow,0.15,5,f1,.4,0,1,100,0.6,0,1,0.2,1.0",
            "b,full,1.0,5,f1,.4,0,1,100,1.0,1,1,0.0,4.0", "b,infoflow,0.15,5,f1,.4,0,1,100,0.8,0,1,0.1,1.0",
            "a,epic,0.15,5,f1,.4,0,1,100,0.5,0,1,0.3,0.5"]  # epic only on a: left out of the macro front
    (tmp_path / "summary.csv").write_text(head + "\n".join(rows) + "\n")
    (tmp_path / "ttft.csv").write_text(
        "shape,context,row,tier,ttft_ms\ns,8192,HF SDPA full,-,30\ns,8192,kvfuse full first-sight,pool,20\n"
        "s,8192,kvfuse infoflow@15% first-sight,pool,12\ns,2048,kvfuse full first-sight,pool,5\n")
    assert rel_ttft_from(f"{tmp_path / 'ttft.csv'}:s:8192") == {("infoflow", 0.15): pytest.approx(0.6)}
    f = build_front(tmp_path / "summary.csv", {"cpu": str(tmp_path / "summary.csv"),
                                               "cuda": f"{tmp_path / 'ttft.csv'}:s:8192"},
                    model="m", adapter="", default=("infoflow", 0.15))
    (p,) = [p for p in f.points if p.strategy != "full"]
    assert (p.strategy, p.ratio) == ("infoflow", 0.15)
    assert p.fidelity == pytest.approx(0.7) and p.kl == pytest.approx(0.15)
    assert p.rel_ttft["cpu"] == pytest.approx((0.5 + 0.25) / 2) and p.rel_ttft["cuda"] == pytest.approx(0.6)
    # several sources for one device: a point takes the first source that measured it, the rest fill in
    (tmp_path / "ttft2.csv").write_text(
        "shape,context,row,tier,ttft_ms\ns,8192,kvfuse full first-sight,pool,10\n"
        "s,8192,kvfuse infoflow@15% first-sight,pool,9\ns,8192,kvfuse infoflow@30% first-sight,pool,8\n")
    rows.append("a,infoflow,0.3,5,f1,.4,0,1,100,0.9,0,1,0.05,1.5")
    rows.append("b,infoflow,0.3,5,f1,.4,0,1,100,0.9,0,1,0.05,2.5")
    (tmp_path / "summary.csv").write_text(head + "\n".join(rows) + "\n")
    f = build_front(tmp_path / "summary.csv", {"cuda": [f"{tmp_path / 'ttft.csv'}:s:8192",
                                                        f"{tmp_path / 'ttft2.csv'}:s:8192"]},
                    model="m", adapter="", default=("infoflow", 0.15))
    rel = {p.key[:2]: p.rel_ttft.get("cuda") for p in f.points if p.strategy != "full"}
    assert rel == {("infoflow", 0.15): pytest.approx(0.6), ("infoflow", 0.3): pytest.approx(0.8)}
    # a target the 15% point misses is met by the 30% one, not by jumping to full prefill
    c = f.choose("cuda", target_fidelity=0.85)
    assert (c.strategy, c.ratio) == ("infoflow", 0.3)


def test_the_packaged_fronts_describe_the_shipped_adapter_and_none():
    from importlib.resources import files

    from kvfuse.engine.adapter import load_adapter

    digest = load_adapter(files("kvfuse").joinpath("data/adapters/qwen2.5-coder-0.5b.safetensors")).digest[:16]
    with_adapter = packaged_front("qwen2.5-coder-0.5b", digest)
    without = packaged_front("qwen2.5-coder-0.5b", "")
    assert with_adapter is not None and without is not None and with_adapter != without
    assert packaged_front("qwen2.5-coder-0.5b", "0" * 16) is None and packaged_front("smollm2-135m", "") is None
    for f in (with_adapter, without):
        assert f.default == ("infoflow", 0.15)
        assert {"cpu", "cuda"} <= {d for p in f.points for d in p.rel_ttft}


def test_options_take_auto_targets_only_with_auto():
    o = GenerationOptions(strategy="auto", target_fidelity=0.8)
    assert o.make_strategy() is None and o.target_fidelity == 0.8
    for bad, match in ((dict(target_fidelity=0.8), "option of strategy 'auto'"),
                       (dict(strategy="auto", target_fidelity=0.8, ttft_budget_s=1.0), "not both"),
                       (dict(strategy="auto", target_fidelity=1.5), "target_fidelity"),
                       (dict(strategy="auto", ttft_budget_s=0.0), "ttft_budget_s"),
                       (dict(strategy="auto", strategy_options={"gradual": True}), "no strategy options")):
        with pytest.raises(ValueError, match=match):
            GenerationOptions(**bad)


def test_the_rate_is_a_moving_average_of_full_equivalent_seconds_per_token():
    r = TtftRate(weight=0.5)
    assert r.predict_full(100) is None
    r.observe(1.0, 100, 1.0)      # full: 0.01 s/token
    r.observe(0.5, 100, 0.25)     # a point 4x cheaper than full: 0.02 s/token full-equivalent
    r.observe(9.0, 100, None)     # not on the front: ignored
    assert r.value == pytest.approx(0.015) and r.samples == 2
    assert r.predict_full(200) == pytest.approx(3.0)


def test_a_first_token_guard_is_a_point_whose_ttft_adds_its_hand_overs(tmp_path):
    """A run guarded at the first token ("+guard1/1") becomes a point of its own: its fidelity as measured, its
    relative TTFT the unguarded point's plus the share handed over (read from the recompute fraction); a guard
    checking every token is left off; the point round-trips and a target it meets picks it over full prefill."""
    head = ("dataset,strategy,ratio,n,metric,score,score_lo,score_hi,rel_full_pct,fidelity,fidelity_lo,fidelity_hi,"
            "kl,ttft_s,recompute_fraction\n")
    rows = ["a,full,1.0,5,f1,.4,0,1,100,1.0,1,1,0.0,2.0,1.0", "a,infoflow,0.15,5,f1,.4,0,1,100,0.6,0,1,0.2,1.0,0.15",
            "a,infoflow+guard1/1,0.15,5,f1,.4,0,1,100,0.9,0,1,0.05,1.5,0.405",  # 30% handed over: .15 + .3 * .85
            "a,infoflow+guard1,0.15,5,f1,.4,0,1,100,0.99,0,1,0.01,1.9,0.9",  # every token: not a front point
            "b,full,1.0,5,f1,.4,0,1,100,1.0,1,1,0.0,4.0,1.0", "b,infoflow,0.15,5,f1,.4,0,1,100,0.8,0,1,0.1,1.0,0.15",
            "b,infoflow+guard1/1,0.15,5,f1,.4,0,1,100,0.96,0,1,0.03,1.5,0.235",  # 10% handed over
            "b,infoflow+guard1,0.15,5,f1,.4,0,1,100,0.99,0,1,0.01,1.9,0.9"]
    (tmp_path / "s.csv").write_text(head + "\n".join(rows) + "\n")
    (tmp_path / "ttft.csv").write_text("shape,context,row,tier,ttft_ms\ns,8192,kvfuse full first-sight,pool,20\n"
                                       "s,8192,kvfuse infoflow@15% first-sight,pool,10\n")
    f = build_front(tmp_path / "s.csv", {"cuda": f"{tmp_path / 'ttft.csv'}:s:8192"}, model="m", adapter="",
                    default=("infoflow", 0.15))
    plain, guarded = [p for p in f.points if p.strategy == "infoflow"]
    assert (plain.guard, guarded.guard, guarded.guard_tokens) == (0.0, 1.0, 1)
    assert guarded.fidelity == pytest.approx(0.93) and guarded.kl == pytest.approx(0.04)
    assert guarded.rel_ttft["cuda"] == pytest.approx(0.5 + (0.3 + 0.1) / 2)
    c = f.choose("cuda", target_fidelity=0.9)
    assert (c.strategy, c.guard, c.guard_tokens) == ("infoflow", 1.0, 1)
    assert c.as_dict()["guard_margin"] == 1.0 and "guard_margin" not in f.choose("cuda").as_dict()
    assert f.choose("cuda").guard == 0.0  # the default point is the unguarded one
    assert Front.from_json(json.loads(json.dumps(f.to_json()))) == f
    with pytest.raises(ValueError, match="never guarded"):
        FrontPoint("full", 1.0, 1.0, guard=1.0)
    with pytest.raises(ValueError, match="guard_tokens"):
        FrontPoint("infoflow", 0.15, 0.9, guard_tokens=1)
    with pytest.raises(ValueError, match="guard"):
        FrontPoint("infoflow", 0.15, 0.9, guard=float("nan"))


@pytest.fixture(scope="module")
def engine():
    import fixtures

    model, tok, info = fixtures.load_tiny("llama", dtype=torch.float32)
    e = fixtures.engine_from(model, tok, info, disk_budget_bytes=0)
    e.precompute(DOCS)
    yield e
    e.close()


def test_an_engine_without_a_matching_front_refuses_auto_before_any_work(engine):
    engine.front = None
    misses = engine.store.snapshot().misses
    with pytest.raises(ValueError, match="measured front"):
        engine.generate(QUESTION, [("new", "A document never seen before.")], strategy="auto")
    engine.front = front("0123456789abcdef")  # measured with another adapter
    with pytest.raises(ValueError, match="adapter"):
        engine.generate(QUESTION, DOCS, strategy="auto", target_fidelity=0.5)
    assert engine.store.snapshot().misses == misses  # nothing was computed


def test_auto_serves_the_chosen_point_exactly_as_naming_it(engine):
    engine.front = front()
    r = engine.generate(QUESTION, DOCS, strategy="auto", target_fidelity=0.5, max_new_tokens=6)
    assert (r.strategy, r.recompute_ratio) == ("cacheblend", 0.15)
    assert r.extra["auto"]["strategy"] == "cacheblend" and r.extra["auto"]["fidelity"] == 0.55
    named = engine.generate(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.15, max_new_tokens=6)
    assert r.token_ids == named.token_ids and r.recomputed_positions == named.recomputed_positions
    r = engine.generate(QUESTION, DOCS, strategy="auto", target_fidelity=0.99, max_new_tokens=6)
    full = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=6)
    assert r.strategy == "full" and r.token_ids == full.token_ids


def test_auto_serves_a_guarded_point_with_its_guard(engine):
    """A point measured with a first-token guard is served with that guard: here one above every margin, so the
    fused answer is handed to full prefill at its first token and the answer is full prefill's."""
    engine.front = Front("m", "", POINTS + (FrontPoint("reuse", 0.0, 0.95, 0.01, {"cpu": 0.2}, 1e9, 1),),
                         ("infoflow", 0.15))
    r = engine.generate(QUESTION, DOCS, strategy="auto", target_fidelity=0.9, max_new_tokens=6)
    full = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=6)
    assert r.extra["auto"]["strategy"] == "reuse" and r.extra["auto"]["guard_margin"] == 1e9
    assert r.extra["guard"]["requested"] == "reuse" and r.extra["guard"]["escalated_at"] == 0
    assert r.strategy == "full" and r.token_ids == full.token_ids
    plain = engine.generate(QUESTION, DOCS, strategy="auto", target_fidelity=0.3, max_new_tokens=6)
    assert plain.strategy == "reuse" and "guard" not in plain.extra  # an unguarded point: no guard


def test_a_probe_guard_is_a_point_whose_ttft_swaps_the_fused_prefill_for_the_probe(tmp_path):
    """A run guarded at the question probe ("+probeguard1") becomes a point of its own: its fidelity as measured,
    its relative TTFT (1 - s) base + s (p base + 1), with s the share handed over and p the probe's share of the
    strategy's TTFT (`probe_share`; 1 where not given, the first-token formula's base + s); it round-trips."""
    head = ("dataset,strategy,ratio,n,metric,score,score_lo,score_hi,rel_full_pct,fidelity,fidelity_lo,fidelity_hi,"
            "kl,ttft_s,recompute_fraction\n")
    rows = ["a,full,1.0,5,f1,.4,0,1,100,1.0,1,1,0.0,2.0,1.0", "a,infoflow,0.15,5,f1,.4,0,1,100,0.6,0,1,0.2,1.0,0.15",
            "a,infoflow+probeguard1,0.15,5,f1,.4,0,1,100,0.9,0,1,0.05,1.5,0.405",  # 30% handed over
            "b,full,1.0,5,f1,.4,0,1,100,1.0,1,1,0.0,4.0,1.0", "b,infoflow,0.15,5,f1,.4,0,1,100,0.8,0,1,0.1,1.0,0.15",
            "b,infoflow+probeguard1,0.15,5,f1,.4,0,1,100,0.96,0,1,0.03,1.5,0.235"]  # 10%
    (tmp_path / "s.csv").write_text(head + "\n".join(rows) + "\n")
    (tmp_path / "ttft.csv").write_text("shape,context,row,tier,ttft_ms\ns,8192,kvfuse full first-sight,pool,20\n"
                                       "s,8192,kvfuse infoflow@15% first-sight,pool,10\n")
    rel = {"cuda": f"{tmp_path / 'ttft.csv'}:s:8192", "cpu": str(tmp_path / "s.csv")}
    f = build_front(tmp_path / "s.csv", rel, model="m", adapter="", default=("infoflow", 0.15),
                    probe_share={"cuda": 0.2})
    plain, guarded = [p for p in f.points if p.strategy == "infoflow"]
    assert (guarded.guard, guarded.guard_tokens, guarded.guard_at) == (1.0, None, "probe")
    assert guarded.fidelity == pytest.approx(0.93)
    s = (0.3 + 0.1) / 2
    assert guarded.rel_ttft["cuda"] == pytest.approx((1 - s) * 0.5 + s * (0.2 * 0.5 + 1))
    base_cpu = plain.rel_ttft["cpu"]
    assert guarded.rel_ttft["cpu"] == pytest.approx(base_cpu + s)  # no probe share given: the upper bound
    again = Front.from_json(json.loads(json.dumps(f.to_json())))
    assert [p.key for p in again.points] == [p.key for p in f.points]
    c = f.choose("cuda", target_fidelity=0.9)
    assert (c.guard, c.guard_at) == (1.0, "probe") and c.as_dict()["guard_at"] == "probe"
    with pytest.raises(ValueError, match="guard_at"):
        FrontPoint("infoflow", 0.15, 0.9, guard=1.0, guard_tokens=1, guard_at="probe")
    with pytest.raises(ValueError, match="guard_at"):
        FrontPoint("infoflow", 0.15, 0.9, guard_at="probe")


def test_auto_serves_a_probe_guarded_point_with_its_guard(engine):
    """A point guarded at the probe is served so: above every gap, the request is full prefill's, handed over at
    the probe."""
    engine.front = Front("m", "", POINTS + (FrontPoint("prophetkv", 0.3, 0.95, 0.01, {"cpu": 0.5}, 1e9, None,
                                                       "probe"),), ("infoflow", 0.15))
    r = engine.generate(QUESTION, DOCS, strategy="auto", target_fidelity=0.9, max_new_tokens=6)
    full = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=6)
    assert r.extra["auto"]["guard_at"] == "probe" and r.extra["guard"]["at"] == "probe"
    assert r.strategy == "full" and r.token_ids == full.token_ids


def test_auto_with_a_budget_predicts_from_the_engines_own_rate(engine):
    engine.front = front()
    engine.ttft_rate = TtftRate()
    r = engine.generate(QUESTION, DOCS, strategy="auto", ttft_budget_s=1e-9, max_new_tokens=2)
    assert engine.ttft_rate.samples >= 2  # calibrated before the request, then fed by it
    assert (r.strategy, r.extra["auto"]["budget_met"]) == ("reuse", False)
    r = engine.generate(QUESTION, DOCS, strategy="auto", ttft_budget_s=3600.0, max_new_tokens=2)
    assert (r.strategy, r.extra["auto"]["budget_met"]) == ("full", True)
    pred = engine.choose_auto(r.prompt_tokens, ttft_budget_s=3600.0).predicted_ttft_s
    assert pred == pytest.approx(engine.ttft_rate.value * r.prompt_tokens)


CUDA_REL = "cuda=docs/gpu/ttft_ratios_05b.csv:qwen05b:8192"


@pytest.mark.parametrize("adapter, quality, guarded, rel, name", [
    ("packaged", "docs/quality/adapter_gpu/ratios_summary.csv",
     ["docs/quality/guard/summary60.csv", "docs/quality/guard/probe60/summary.csv"],
     ["cpu=docs/quality/q60/summary.csv", "cpu=docs/quality/sweep20/summary.csv", CUDA_REL], "qwen2.5-coder-0.5b.json"),
    ("none", "docs/quality/q60/summary.csv", None, ["cpu=docs/quality/q60/summary.csv", CUDA_REL],
     "qwen2.5-coder-0.5b.none.json")])
def test_the_shipped_fronts_are_rebuilt_by_kvfuse_front_from_committed_measurements(tmp_path, adapter, quality, guarded,
                                                                                     rel, name):
    from pathlib import Path

    from kvfuse.cli import main

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / name
    rels = [a for r in rel for a in ("--rel", r.replace("=", f"={root}/", 1))]
    more = [a for g in guarded or [] for a in ("--guarded", str(root / g))]
    if guarded:  # the probe's share of infoflow's TTFT: the CPU records (guard.md), the H200 (docs/gpu/README.md)
        more += ["--probe-share", "cpu=0.25", "--probe-share", "cuda=0.18"]
    rc = main(["front", "--quality", str(root / quality), *rels, *more,
               "--model", "qwen2.5-coder-0.5b", "--adapter", adapter, "--out", str(out)])
    assert rc == 0
    built, shipped = Front.load(out), Front.load(root / "kvfuse/data/fronts" / name)
    assert (built.model, built.adapter, built.points, built.default) == (
        shipped.model, shipped.adapter, shipped.points, shipped.default)
    assert any(p.guard for p in shipped.points) == bool(guarded)  # the shipped adapter's front has guarded points
    assert any(p.guard_at == "probe" for p in shipped.points) == bool(guarded)


def test_every_served_point_on_the_front_feeds_the_rate(engine):
    """reuse reports ratio 0 whatever was asked, full 1: both still count; a point not on the front does not."""
    engine.front = front()
    engine.ttft_rate = TtftRate()
    engine.generate(QUESTION, DOCS, strategy="reuse", recompute_ratio=0.15, max_new_tokens=1)
    engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=1)
    assert engine.ttft_rate.samples == 2
    engine.generate(QUESTION, DOCS, strategy="epic", recompute_ratio=0.15, max_new_tokens=1)  # not on it
    assert engine.ttft_rate.samples == 2


def test_a_front_never_reads_guarded_runs_as_their_strategy():
    """docs/quality/guard/summary20.csv holds infoflow with and without guards: the front's infoflow point is the
    unguarded one (a guarded run's fidelity and TTFT depend on how often its guard trips)."""
    from pathlib import Path

    from kvfuse.engine.auto import quality_from_eval, rel_ttft_from

    src = Path(__file__).resolve().parents[2] / "docs" / "quality" / "guard" / "summary20.csv"
    q = quality_from_eval(src)
    assert list(q) == [("infoflow", 0.15)]
    assert abs(q[("infoflow", 0.15)][0] - (0.9286 + 0.8262 + 0.55) / 3) < 2e-3  # not 0.874 (guard 0.5)
    assert list(rel_ttft_from(str(src))) == [("infoflow", 0.15)]
