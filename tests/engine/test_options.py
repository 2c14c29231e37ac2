"""GenerationOptions: validated at construction, immutable, and the same request as the engine's keywords."""
from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from cases import DOCS, QUESTION

from kvfuse.engine.fusion import DEFAULT_STRATEGY
from kvfuse.engine.fusion.cacheblend import CacheBlend
from kvfuse.engine.options import GenerationOptions

TIMES = ("ttft_s", "prefill_s", "decode_s", "selection_s", "miss_prefill_s", "queue_s")


def same_result(a, b) -> None:
    """Every field of two GenerationResults but the timings; extra tensors bit for bit."""
    da, db = a.as_dict(), b.as_dict()
    ea, eb = da.pop("extra"), db.pop("extra")
    for k in TIMES:
        da.pop(k), db.pop(k)
    assert da == db
    assert ea.keys() == eb.keys()
    for k in ea:
        if isinstance(ea[k], torch.Tensor):
            torch.testing.assert_close(ea[k], eb[k], rtol=0, atol=0)
        else:
            assert ea[k] == eb[k], k


def test_defaults_and_normalisation():
    o = GenerationOptions()
    assert (o.strategy, o.recompute_ratio, o.max_new_tokens, o.temperature, o.top_p, o.seed, o.stop,
            o.teacher_ids, o.return_logprobs, dict(o.strategy_options)) == (
        DEFAULT_STRATEGY, 0.15, 64, 0.0, 1.0, None, (), None, False, {})
    assert GenerationOptions(stop="END").stop == ("END",)
    assert GenerationOptions(stop=["a", "b"]).stop == ("a", "b") and GenerationOptions(stop=None).stop == ()
    assert GenerationOptions(teacher_ids=torch.tensor([3, 1])).teacher_ids == (3, 1)
    assert GenerationOptions(recompute_ratio=1).recompute_ratio == 1.0
    assert GenerationOptions(stop="x") == GenerationOptions(stop=("x",))
    assert hash(GenerationOptions(stop="x")) == hash(GenerationOptions(stop=["x"]))
    assert GenerationOptions(strategy="cacheblend").strategy_name == "cacheblend"
    blend = CacheBlend(gradual=True)
    o = GenerationOptions(strategy=blend)
    assert o.strategy_name == "cacheblend" and o.make_strategy() is blend


def test_frozen_and_read_only_strategy_options():
    given = {"gradual": True}
    o = GenerationOptions(strategy="cacheblend", strategy_options=given)
    given["n_checks"] = 5  # the caller's dict is copied
    assert dict(o.strategy_options) == {"gradual": True}
    with pytest.raises(TypeError):
        o.strategy_options["gradual"] = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.max_new_tokens = 3
    s1, s2 = o.make_strategy(), o.make_strategy()
    assert s1 is not s2 and s1.gradual and s2.gradual  # a new instance per request


@pytest.mark.parametrize("kwargs,match", [
    (dict(strategy="nope"), "unknown strategy 'nope'"),
    (dict(strategy=3), "strategy must be a strategy name"),
    (dict(strategy="cacheblend", strategy_options={"no_such": 1}), "strategy 'cacheblend'"),
    (dict(strategy_options=[("gradual", True)]), "strategy_options must be a mapping"),
    (dict(strategy_options={1: True}), "strategy_options keys must be keyword names"),
    (dict(recompute_ratio=1.5), r"recompute_ratio must be in \[0, 1\]"),
    (dict(recompute_ratio="0.1"), "recompute_ratio must be a number"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an int"),
    (dict(temperature=-1), "temperature must be in"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(seed="7"), "seed must be None or an int"),
    (dict(stop=["ok", ""]), r"stop\[1\] is an empty string"),
    (dict(stop=7), "stop must be a string or a list"),
    (dict(teacher_ids=[1, -1]), r"teacher_ids\[1\] must be a token id, a non-negative int"),
    (dict(teacher_ids=[1.0]), r"teacher_ids\[0\] must be a token id"),
    (dict(teacher_ids="12"), "teacher_ids must be a list of token ids"),
    (dict(return_logprobs=1), "return_logprobs must be True or False"),
])
def test_bad_field_is_one_value_error_naming_it(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerationOptions(**kwargs)
    with pytest.raises(ValueError, match=match):  # replace validates again
        GenerationOptions().replace(**kwargs)


def test_replace_from_kwargs_as_kwargs_pickle():
    o = GenerationOptions(strategy="cacheblend", max_new_tokens=8, strategy_options={"gradual": True})
    r = o.replace(max_new_tokens=4, stop="x")
    assert (r.max_new_tokens, r.stop, dict(r.strategy_options), o.max_new_tokens) == (4, ("x",), {"gradual": True}, 8)
    with pytest.raises(TypeError):
        o.replace(gradual=False)  # replace takes field names only
    k = GenerationOptions.from_kwargs(strategy="cacheblend", max_new_tokens=8, gradual=True)
    assert k == o and GenerationOptions.from_kwargs(**o.as_kwargs()) == o
    assert dict(GenerationOptions.from_kwargs(strategy="cacheblend", strategy_options={"gradual": True},
                                              n_checks=2).strategy_options) == {"gradual": True, "n_checks": 2}
    with pytest.raises(ValueError, match="strategy 'cacheblend'"):
        GenerationOptions.from_kwargs(strategy="cacheblend", no_such_option=1)
    assert pickle.loads(pickle.dumps(o)) == o and copy.deepcopy(o) == o and copy.copy(o) == o


def test_options_and_keywords_give_identical_requests(tiny_engine):
    engine = tiny_engine("qwen2")
    engine.precompute(DOCS)  # every request below hits alike
    kw = dict(strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=5, temperature=0.8, top_p=0.9, seed=11,
              stop=["never-in-the-answer"], teacher_ids=[5, 6, 7], return_logprobs=True, gradual=True)
    opts = GenerationOptions.from_kwargs(**kw)
    by_kw = engine.generate(QUESTION, DOCS, **kw)
    by_opts = engine.generate(QUESTION, DOCS, opts)
    same_result(by_kw, by_opts)
    assert by_kw.strategy == "cacheblend" and len(by_kw.token_ids) >= 1
    # keywords override the fields of `options` (and add strategy options)
    base = GenerationOptions(strategy="cacheblend", max_new_tokens=2, temperature=0.8, top_p=0.9, seed=3)
    same_result(engine.generate(QUESTION, DOCS, base, max_new_tokens=5, seed=11, recompute_ratio=0.3,
                                stop=["never-in-the-answer"], teacher_ids=[5, 6, 7], return_logprobs=True,
                                gradual=True), by_kw)
    # streams, both ways
    s1, s2 = engine.stream(QUESTION, DOCS, **kw), engine.stream(QUESTION, DOCS, options=opts)
    assert "".join(s1) == "".join(s2) == by_kw.text
    same_result(s1.result, s2.result)
    # chats, both ways
    chat_kw = {k: v for k, v in kw.items() if k != "teacher_ids"}
    msgs = [{"role": "user", "content": f"{DOCS[0][1]}\n\n{DOCS[1][1]}\n\n{QUESTION}"}]
    c1 = engine.chat(msgs, **chat_kw)
    c2 = engine.chat(msgs, options=opts.replace(teacher_ids=None))
    same_result(c1, c2)
    s1, s2 = engine.stream_chat(msgs, **chat_kw), engine.stream_chat(msgs, options=GenerationOptions.from_kwargs(**chat_kw))
    assert "".join(s1) == "".join(s2) == c1.text


def test_engine_checks_options_against_the_model_before_any_work(tiny_engine):
    engine = tiny_engine("llama")
    vocab = engine.decoder.spec.vocab
    calls = []
    engine.runner.prefill = lambda *a, **k: calls.append("prefill")
    engine.store.lookup = lambda *a, **k: calls.append("lookup")
    too_long = GenerationOptions(max_new_tokens=engine.context_window)
    with pytest.raises(ValueError, match="max_new_tokens must be <="):
        engine.generate(QUESTION, DOCS, too_long)
    with pytest.raises(ValueError, match=rf"teacher_ids\[1\] must be a token id, an int in \[0, {vocab}\)"):
        engine.stream(QUESTION, DOCS, GenerationOptions(teacher_ids=[1, vocab]))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):  # a keyword overriding options, checked
        engine.generate(QUESTION, DOCS, GenerationOptions(), max_new_tokens=0)
    with pytest.raises(ValueError, match="teacher_ids is not supported for a chat"):
        engine.chat(QUESTION, options=GenerationOptions(teacher_ids=[1]))
    with pytest.raises(ValueError, match="options must be a GenerationOptions, got dict"):
        engine.generate(QUESTION, DOCS, {"max_new_tokens": 2})
    assert calls == []
