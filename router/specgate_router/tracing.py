"""OpenTelemetry spans of the router's requests.

With `tracing` configured, each API request gets a server span: a child of the client's
`traceparent` when it sent one (its sampling decision followed), else a new trace sampled at
`sampleRatio`. The engine receives the router's span as its parent, so a trace reads client,
router, SGLang. The span ends when the answer's last byte has gone (a stream's too) and
carries the class, the pod, the status and the request id.

Spans are exported in batches over OTLP/HTTP from the SDK's worker thread, owned by `Tracing`
and flushed at shutdown; its queue is bounded (spans past it are dropped, never waited for),
so a collector that is slow or gone costs the request path nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import replace
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from specgate import api
from specgate_router.requests import RoutedRequest

EXPORT_TIMEOUT_SECONDS = 5.0
MAX_QUEUED_SPANS = 4096


class Tracing:
    def __init__(self, settings: api.RouterTracing, identity: str) -> None:
        self.provider = TracerProvider(
            resource=Resource.create(
                {"service.name": "specgate-router", "service.instance.id": identity}
            ),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        )
        self.provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=settings.otlp_endpoint, timeout=EXPORT_TIMEOUT_SECONDS),
                max_queue_size=MAX_QUEUED_SPANS,
            )
        )
        self.tracer = self.provider.get_tracer("specgate.router")
        self.propagator = TraceContextTextMapPropagator()

    def start(self, routed: RoutedRequest, request_id: str) -> tuple[Span, RoutedRequest]:
        """The request's span, and the request carrying it as the engine's parent."""
        parent = self.propagator.extract(dict(routed.trace))
        span = self.tracer.start_span(
            f"POST {routed.path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "url.path": routed.path,
                "specgate.traffic_class": routed.traffic_class,
                "specgate.request_id": request_id,
                "specgate.stream": routed.stream,
            },
        )
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        state = dict(routed.trace).get("tracestate")
        context = [("traceparent", carrier["traceparent"])] if "traceparent" in carrier else []
        if state is not None and context:
            context.append(("tracestate", state))
        return span, replace(routed, trace=tuple(context))

    @staticmethod
    def answered(span: Span, status: int, pod: str | None) -> None:
        span.set_attribute("http.response.status_code", status)
        if pod is not None:
            span.set_attribute("specgate.pod", pod)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))

    @staticmethod
    def failed(span: Span, exc: BaseException) -> None:
        status = getattr(exc, "status", 500)
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("error.type", type(exc).__name__)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
        span.end()

    @staticmethod
    async def ending_with(span: Span, chunks: AsyncIterable[Any]) -> AsyncIterator[Any]:
        """A stream's chunks, the span ending after the last (or when the client leaves)."""
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            span.end()

    def shutdown(self) -> None:
        """Export what is queued (bounded by the export timeout) and stop the worker."""
        self.provider.shutdown()
