"""Traces (OpenTelemetry): the admin write path and a routed request, across processes.

Exported over OTLP/HTTP only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the SDK reads the
``OTEL_*`` variables: endpoint, headers, service name); otherwise nothing is recorded and every
hook is a flag test, so a router without tracing pays nothing per request. Tests install an
in-process exporter with :func:`install`.

Context crosses processes as W3C ``traceparent`` (and ``tracestate``): from an HTTP client into
the admin API and the router, from the router to the worker it chose, and from a PATCH to the
routers that apply it, as a header of the policy message on the bus (never in its signed,
stored payload): the router's apply span is *linked* to the PATCH's span (it is not its child:
one PATCH is applied by every router, at its own time).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from controlplane.protocol.subjects import HDR_TRACEPARENT, HDR_TRACESTATE

log = logging.getLogger(__name__)

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACEPARENT = HDR_TRACEPARENT
TRACESTATE = HDR_TRACESTATE
_PROPAGATOR = TraceContextTextMapPropagator()


class _State:
    enabled = False  # a provider records spans (setup_tracing or install)
    provider: TracerProvider | None = None


def enabled() -> bool:
    """Whether spans are recorded: the cheap check every hot-path hook makes first."""
    return _State.enabled


def setup_tracing(service_name: str) -> bool:
    """Entry points: export spans over OTLP/HTTP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.
    Returns whether tracing is on."""
    if not os.environ.get(ENDPOINT_ENV):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    install(BatchSpanProcessor(OTLPSpanExporter()), service_name=service_name)
    log.info("traces exported over OTLP to %s", os.environ[ENDPOINT_ENV])
    return True


def install(processor: SpanProcessor, *, service_name: str = "rudder") -> TracerProvider:
    """Record spans into ``processor`` (the process-wide provider is set once; a later call adds
    its processor to the same provider)."""
    if _State.provider is None:
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        trace.set_tracer_provider(provider)
        _State.provider = provider
    _State.provider.add_span_processor(processor)
    _State.enabled = True
    return _State.provider


def disable() -> None:
    """Stop recording (tests: after the module that installed an in-process exporter)."""
    _State.enabled = False


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def extract(headers: Mapping[str, str]) -> otel_context.Context | None:
    """The remote parent a ``traceparent`` header names, or None (none, or malformed)."""
    if TRACEPARENT not in headers:
        return None
    carrier = {TRACEPARENT: headers[TRACEPARENT]}
    if TRACESTATE in headers:
        carrier[TRACESTATE] = headers[TRACESTATE]
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def link_from(headers: Mapping[str, str] | None) -> list[Link]:
    """A link to the span a message's ``traceparent`` header names ([] without one)."""
    ctx = extract(headers) if headers else None
    return [Link(trace.get_current_span(ctx).get_span_context())] if ctx is not None else []


def inject(carrier: MutableMapping[str, str], span: Span | None = None) -> None:
    """Write ``span``'s (or the current span's) ``traceparent`` into ``carrier``."""
    ctx = trace.set_span_in_context(span) if span is not None else None
    carrier.pop(TRACEPARENT, None)
    carrier.pop(TRACESTATE, None)
    _PROPAGATOR.inject(carrier, context=ctx)


@contextmanager
def step(name: str, **attributes: Any) -> Iterator[Span | None]:
    """A child span of the current one for one step, when tracing is on (else None, no cost)."""
    if not _State.enabled:
        yield None
        return
    with tracer("rudder").start_as_current_span(name, attributes=_clean(attributes)) as span:
        yield span


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}


def server_span(name: str, headers: Mapping[str, str], *, start_time: int | None = None,
                **attributes: Any) -> tuple[Span, Any]:
    """Start a request's root span (child of the client's ``traceparent``, if any) and make it
    current; returns it and the token to :func:`detach` (tracing must be on)."""
    span = tracer("rudder").start_span(name, context=extract(headers), kind=SpanKind.SERVER,
                                       attributes=_clean(attributes), start_time=start_time)
    return span, otel_context.attach(trace.set_span_in_context(span))


def detach(token: Any) -> None:
    otel_context.detach(token)


def child(name: str, parent: Span, *, start_time: int | None = None, **attributes: Any) -> Span:
    """A span under ``parent``, started at ``start_time`` (epoch ns; now) and ended by the caller
    (for steps that outlive a ``with`` block: the first token, the end of a stream)."""
    return tracer("rudder").start_span(name, context=trace.set_span_in_context(parent),
                                       attributes=_clean(attributes), start_time=start_time)
