"""kvfuse.engine.tracing: OpenTelemetry spans when the API is installed, a no-op when it is not."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from kvfuse.engine import tracing

otel_trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402


@pytest.fixture
def exporter(monkeypatch):
    """An SDK tracer provider exporting into memory, used as the current provider for this test only (the
    process-wide provider can be set once only, so it is not touched)."""
    exp = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    monkeypatch.setattr(otel_trace, "get_tracer_provider", lambda: provider)
    yield exp
    provider.shutdown()


def test_span_carries_the_attributes(exporter):
    assert tracing.OTEL_AVAILABLE
    with tracing.span("kvfuse.generate", strategy="infoflow", docs=3, ratio=0.15, streamed=False,
                      seed=None, shape=(1, 2)) as s:
        assert s is not None and s.is_recording()
        tracing.set_attributes(s, ttft_s=0.25, cache_hits=2, note=None, tensor=object())
    (got,) = exporter.get_finished_spans()
    assert got.name == "kvfuse.generate"
    assert got.instrumentation_scope.name == "kvfuse"
    assert dict(got.attributes) == {"strategy": "infoflow", "docs": 3, "ratio": 0.15, "streamed": False,
                                    "ttft_s": 0.25, "cache_hits": 2}
    assert got.status.status_code == StatusCode.UNSET


def test_span_records_an_exception(exporter):
    with pytest.raises(ValueError, match="boom"):
        with tracing.span("kvfuse.precompute", docs=1):
            raise ValueError("boom")
    (got,) = exporter.get_finished_spans()
    assert got.status.status_code == StatusCode.ERROR
    (event,) = [e for e in got.events if e.name == "exception"]
    assert event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == "boom"


def test_spans_nest(exporter):
    with tracing.span("outer") as outer, tracing.span("inner") as inner:
        assert inner.parent.span_id == outer.get_span_context().span_id
    assert [s.name for s in exporter.get_finished_spans()] == ["inner", "outer"]


def test_set_attributes_ignores_none_and_finished_spans(exporter):
    tracing.set_attributes(None, a=1)  # no OpenTelemetry: nothing to do
    with tracing.span("s") as s:
        pass
    tracing.set_attributes(s, late=1)  # ended: not recording, silently ignored
    (got,) = exporter.get_finished_spans()
    assert "late" not in got.attributes


def test_flag_off_is_a_no_op(exporter, monkeypatch):
    monkeypatch.setattr(tracing, "OTEL_AVAILABLE", False)
    with tracing.span("kvfuse.generate", strategy="full") as s:
        assert s is None
        tracing.set_attributes(s, x=1)
    with pytest.raises(KeyError):  # exceptions still propagate untouched
        with tracing.span("x"):
            raise KeyError("k")
    assert exporter.get_finished_spans() == ()


def test_without_opentelemetry_installed(monkeypatch):
    """A fresh copy of the module, loaded while `opentelemetry` cannot be imported."""
    for name in [m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # `import opentelemetry...` -> ImportError
    spec = importlib.util.spec_from_file_location("_kvfuse_tracing_no_otel", tracing.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.OTEL_AVAILABLE is False and mod._otel_trace is None
    with mod.span("kvfuse.generate", strategy="full", docs=2) as s:
        assert s is None
        mod.set_attributes(s, ttft_s=1.0)
    with pytest.raises(RuntimeError, match="still raised"):
        with mod.span("x"):
            raise RuntimeError("still raised")
    # reusable and re-entrant: the no-op context manager is shared
    with mod.span("a"), mod.span("b"):
        pass


def test_engine_requests_are_traced(exporter, tiny_engine):
    from cases import DOCS, QUESTION

    engine = tiny_engine("llama")
    engine.precompute(DOCS[:2])
    r = engine.generate(QUESTION, DOCS, strategy="cacheblend", max_new_tokens=2)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"kvfuse.precompute", "kvfuse.prefill"}
    assert spans["kvfuse.precompute"].attributes["computed"] == 2
    got = spans["kvfuse.prefill"].attributes
    assert (got["strategy"], got["cache_hits"], got["cache_misses"]) == ("cacheblend", 2, 1)
    assert (got["prompt_tokens"], got["recomputed_tokens"]) == (r.prompt_tokens, r.recomputed_tokens)
