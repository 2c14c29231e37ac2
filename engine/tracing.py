"""Optional OpenTelemetry spans.

`span(name, **attributes)` opens a span on the tracer named "kvfuse" when the OpenTelemetry API package is
installed (`pip install 'kvfuse[otel]'`); without it, it does nothing (a cached null context, no allocation
beyond the call). The API alone records nothing either: spans reach an exporter only once the application has
configured a tracer provider (opentelemetry-sdk or an auto-instrumentation agent), which kvfuse never does.

    from kvfuse.engine.tracing import span, set_attributes

    with span("kvfuse.generate", strategy="infoflow", docs=3) as s:
        result = ...
        set_attributes(s, ttft_s=result.ttft_s, cache_hits=result.cache_hits)

Attributes: only bool, int, float and str values are set (None and anything else is skipped, so a caller can
pass optional values without checking them). An exception leaving the block is recorded on the span and the
span's status set to ERROR (by OpenTelemetry's own `start_as_current_span`), then re-raised.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["TRACER_NAME", "OTEL_AVAILABLE", "span", "set_attributes"]

TRACER_NAME = "kvfuse"

try:  # the API package only; the SDK is the application's business
    from opentelemetry import trace as _otel_trace
except ImportError:  # pragma: no cover - depends on the environment
    _otel_trace = None

OTEL_AVAILABLE: bool = _otel_trace is not None

_NULL = contextlib.nullcontext(None)  # reusable: nullcontext keeps no state between uses
_ATTR_TYPES = (bool, int, float, str)


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if isinstance(v, _ATTR_TYPES)}


@contextlib.contextmanager
def _otel_span(name: str, attributes: dict[str, Any]) -> Iterator[Any]:
    # The tracer is looked up on every call (cheap) so a tracer provider set after import is honoured.
    tracer = _otel_trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(name, attributes=_clean(attributes), record_exception=True,
                                      set_status_on_exception=True) as s:
        yield s


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A context manager around a span `name` carrying `attributes`; yields the span (None without OpenTelemetry).

    Values that are not bool/int/float/str (None included) are left out. Exceptions are recorded on the span
    and re-raised.
    """
    if not OTEL_AVAILABLE:
        return _NULL
    return _otel_span(name, attributes)


def set_attributes(span_obj: Any, **attributes: Any) -> None:
    """Sets attributes known only later (e.g. at the end of the block) on the span `span(...)` yielded.

    Does nothing when `span_obj` is None (no OpenTelemetry) or the span is not recording; values that are not
    bool/int/float/str are left out.
    """
    if span_obj is None:
        return
    is_recording = getattr(span_obj, "is_recording", None)
    if is_recording is not None and not is_recording():
        return
    clean = _clean(attributes)
    if clean:
        span_obj.set_attributes(clean)
