"""OpenTelemetry traces of every process: a gateway request's span, the worker's answer and each model call, the
learner's join of its feedback, in one trace. The W3C trace context travels in the query record's Kafka headers
(``traceparent``), and in the experience message (``trace``: a batch of experience records goes out in one send,
which has one set of headers). GenAI semantic-convention attributes where they apply
(``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.response.id``).

Nothing is recorded unless configured: ``RLENS_OTEL_ENDPOINT`` exports over OTLP/HTTP (the ``otel`` extra), and
``RLENS_TRACE_DIR`` writes each process's spans as JSON lines to ``<dir>/<role>-<pid>.jsonl`` (what the tests and a
quick look use). Without either, the API's no-op tracer costs next to nothing.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from rlens.settings import Settings

TRACER = "rlens"
_enabled = False  # a tracer provider records (setup_tracing configured one)


def setup_tracing(settings: Settings, role: str) -> None:
    """The process's tracer provider, when traces are configured."""
    if not settings.otel_endpoint and settings.trace_dir is None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    resource = Resource.create({"service.name": f"rlens-{role}", "service.namespace": "rlens", "rlens.role": role})
    provider = TracerProvider(resource=resource)
    if settings.trace_dir is not None:
        path = Path(settings.trace_dir) / f"{role}-{os.getpid()}.jsonl"
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    if settings.otel_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError("RLENS_OTEL_ENDPOINT needs the OTLP exporter: pip install 'rlens[otel]'") from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otel_endpoint)))
    trace.set_tracer_provider(provider)
    global _enabled
    _enabled = True


def tracing() -> bool:
    """Whether spans are recorded in this process (else callers skip building them)."""
    return _enabled


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER)


def trace_carrier(context: Context | None = None) -> dict[str, str]:
    """The W3C trace context of ``context`` (default: the current one) as record headers; {} without a span."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def context_of(headers: Sequence[tuple[str, bytes]] | None) -> Context:
    """The trace context a record's headers carry (an empty one without)."""
    carrier = {k: v.decode("latin-1") for k, v in headers or () if k in ("traceparent", "tracestate")}
    return propagate.extract(carrier)


def context_of_traceparent(value: str | None) -> Context:
    return propagate.extract({"traceparent": value} if value else {})


class JsonLinesExporter(SpanExporter):
    """A span exporter writing each span as one JSON line (the SDK's ``ReadableSpan.to_json``), appended."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.lock = path, threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(span.to_json())) + "\n" for span in spans)
        with self.lock, self.path.open("a") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
