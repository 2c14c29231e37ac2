"""Property: whatever arguments `engine.generate` gets, it either raises one ValueError naming a bad argument before
any work (no prefill, no decode, no cache lookup or write; counters unchanged), or, when every argument is valid,
returns a normal result. Whether a value is valid comes from which of this file's lists it was drawn from (its own
reading of the API contract), never from the engine's checks. Valid lengths stay small: a prompt that overflows the
context window only once its documents are tokenized is out of scope here (see test_api.py)."""
from __future__ import annotations

import math
import os

import pytest
from cases import DOCS
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

VOCAB = 49152  # the tiny llama's output vocabulary
WINDOW = 4096  # its context window

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
#: a string holding at least one lone surrogate somewhere
SURROGATE_TEXT = st.tuples(st.text(max_size=4), SURROGATES, st.text(max_size=4)).map("".join)
WRONG_TYPES = st.one_of(st.none(), st.booleans(), st.binary(max_size=3), st.lists(st.integers(), max_size=2),
                        st.dictionaries(st.text(max_size=2), st.integers(), max_size=1), st.complex_numbers())
NOT_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


#: argument -> (strategy of valid values, strategy of invalid values)
ARGS = {
    "max_new_tokens": (
        st.integers(1, 3),
        st.one_of(st.integers(max_value=0), st.integers(min_value=WINDOW, max_value=1 << 80), st.floats(0, 5),
                  st.text(st.sampled_from("0123456789"), min_size=1, max_size=2), WRONG_TYPES)),
    "temperature": (
        st.one_of(st.floats(0, 3), st.sampled_from([0, 1, 5e-324, 1e-300, 1e300])),
        st.one_of(st.floats(max_value=-1e-300), NOT_FINITE, st.sampled_from(["0.5", "1"]), WRONG_TYPES)),
    "top_p": (
        st.one_of(st.floats(1e-300, 1.0), st.just(1)),
        st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True),
                  st.sampled_from([math.nan, "0.9"]), WRONG_TYPES)),
    "recompute_ratio": (
        st.one_of(st.floats(0, 1), st.sampled_from([0, 1])),
        st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.0, exclude_min=True),
                  st.sampled_from([math.nan, "0.2"]), WRONG_TYPES)),
    "seed": (
        st.one_of(st.none(), st.integers(-(1 << 63), (1 << 64) - 1)),
        st.one_of(st.integers(min_value=1 << 64), st.integers(max_value=-(1 << 63) - 1), st.floats(),
                  st.booleans(), st.text(max_size=2), st.binary(max_size=2))),
    "stop": (
        st.one_of(st.none(), st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3),
                  st.lists(st.text(min_size=1, max_size=4), max_size=3).map(tuple)),
        st.one_of(st.just(""), SURROGATE_TEXT, st.lists(st.just(""), min_size=1, max_size=2),
                  st.lists(SURROGATE_TEXT, min_size=1, max_size=2), st.integers(), st.floats(),
                  st.lists(st.integers(), min_size=1, max_size=2), st.sets(st.text(min_size=1), max_size=2))),
    "teacher_ids": (
        st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), max_size=3)),
        st.one_of(st.lists(st.integers(max_value=-1), min_size=1, max_size=2),
                  st.lists(st.integers(min_value=VOCAB), min_size=1, max_size=2),
                  st.lists(st.floats(), min_size=1, max_size=2), st.lists(st.booleans(), min_size=1, max_size=2),
                  st.text(min_size=1, max_size=3), st.integers())),
    "question": (
        st.text(min_size=1, max_size=12).filter(str.strip),
        st.one_of(st.text(st.sampled_from(" \t\n"), max_size=3), SURROGATE_TEXT, st.integers(), st.none(),
                  st.binary(max_size=3))),
    "docs": (
        st.sampled_from([DOCS, DOCS[:1], [], [(5, DOCS[2][1])]]),
        st.one_of(st.integers(), st.just({"a": "b"}), st.just("a doc"),
                  SURROGATE_TEXT.map(lambda t: [("a", "text " + t)]),
                  SURROGATE_TEXT.map(lambda t: [("id" + t, "text")]),
                  st.one_of(st.booleans(), st.integers(), st.binary(max_size=2)).map(lambda t: [("a", t)]),
                  st.floats().map(lambda x: [(x, "text")]),
                  st.sampled_from([[("a",)], [("a", "  ")], [{"id": "a", "text": 3}], [None]]))),
}
#: what a ValueError about each argument must mention
NAMES = {"max_new_tokens": ("max_new_tokens",), "temperature": ("temperature",), "top_p": ("top_p",),
         "recompute_ratio": ("recompute_ratio",), "seed": ("seed",), "stop": ("stop",),
         "teacher_ids": ("teacher_ids",), "question": ("question",), "docs": ("docs", "document")}


@pytest.fixture
def engine(tiny_engine):
    e = tiny_engine("llama")
    prefills = []
    inner = e.runner.prefill

    def counted(*a, **kw):
        prefills.append(1)
        return inner(*a, **kw)

    e.runner.prefill = counted
    e.prefills = prefills
    return e


@st.composite
def calls(draw):
    """(kwargs, names of the invalid ones): none invalid in about a third of the calls, else one or two."""
    n_bad = draw(st.sampled_from([0, 0, 1, 1, 1, 2]))
    bad_args = draw(st.lists(st.sampled_from(sorted(ARGS)), min_size=n_bad, max_size=n_bad, unique=True))
    kwargs = {k: draw(invalid if k in bad_args else valid) for k, (valid, invalid) in ARGS.items()}
    return kwargs, bad_args


@settings(max_examples=int(os.environ.get("KVFUSE_HYPOTHESIS_EXAMPLES", 50)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(call=calls(), strategy=st.sampled_from(["full", "reuse", "cacheblend"]))
def test_generate_rejects_bad_arguments_before_work_and_answers_valid_ones(engine, call, strategy):
    kwargs, bad_args = call
    kwargs = dict(kwargs)
    question, docs = kwargs.pop("question"), kwargs.pop("docs")
    before, prefills = engine.cache_stats(), len(engine.prefills)
    event(f"invalid: {', '.join(sorted(bad_args))}" if bad_args else "all valid")
    if bad_args:
        with pytest.raises(ValueError) as ei:
            engine.generate(question, docs, strategy=strategy, **kwargs)
        msg = str(ei.value)
        assert "\n" not in msg
        assert any(name in msg for k in bad_args for name in NAMES[k]), (bad_args, msg)
        assert engine.cache_stats() == before and len(engine.prefills) == prefills, "work was done before the error"
        return
    r = engine.generate(question, docs, strategy=strategy, **kwargs)
    assert isinstance(r.text, str) and len(r.token_ids) <= kwargs["max_new_tokens"]
    assert r.finish_reason in ("stop", "length") and all(0 <= t < VOCAB for t in r.token_ids)
    assert math.isfinite(r.ttft_s) and len(engine.prefills) > prefills
    if kwargs["teacher_ids"]:
        lp = r.extra["teacher_logprobs"]
        assert lp.shape == (len(kwargs["teacher_ids"]), VOCAB) and bool(lp.isfinite().all())
    stops = [kwargs["stop"]] if isinstance(kwargs["stop"], str) else list(kwargs["stop"] or [])
    assert not any(s in r.text for s in stops)


def test_the_tiny_engine_matches_the_constants_above(tiny_engine):
    e = tiny_engine("llama")
    assert (e.decoder.spec.vocab, e.context_window) == (VOCAB, WINDOW)
