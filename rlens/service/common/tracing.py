"""OpenTelemetry traces of every process: a gateway request's span, the worker's answer and each model call, the
learner's join of its feedback, in one trace. The W3C trace context travels in the query record's Kafka headers
(``traceparent``), and in the experience message (``trace``: a batch of experience records goes out in one send,
which has one set of headers). GenAI semantic-convention attributes where they apply: ``gen_ai.operation.name``,
``gen_ai.provider.name``, ``gen_ai.request.model``, ``gen_ai.response.model``, ``gen_ai.response.id``,
``gen_ai.usage.input_tokens`` / ``output_tokens``, ``server.address`` / ``server.port`` and ``error.type``; each
model call is its own span, timed as it ran.

A gateway request's trace starts at FastAPI's own HTTP server span (probes untraced: the gateway's app).
Configured as any OpenTelemetry-instrumented service is, by the SDK's own environment variables:
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) exports over OTLP/HTTP (the ``otel``
extra), ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, ``none``), ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` name the process (default ``rlens-<role>``), ``OTEL_TRACES_SAMPLER`` samples,
``OTEL_SDK_DISABLED`` turns it all off. ``RLENS_OTEL_ENDPOINT`` (a full ``/v1/traces`` URL) does what the OTLP
endpoint does. ``RLENS_TRACE_DIR`` writes each process's spans as JSON lines to ``<dir>/<role>-<pid>.jsonl`` (what
the tests and a quick look use). With none of these, the API's no-op tracer costs next to nothing.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Mapping, Sequence
from urllib.parse import urlsplit

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from rlens.models.pool import PoolConfig
from rlens.settings import Settings

TRACER = "rlens"
_enabled = False  # a tracer provider records (setup_tracing configured one)
PROTOCOLS = ("http/protobuf",)  # OTEL_EXPORTER_OTLP_PROTOCOL values rlens can export with (its `otel` extra)


def exporters(settings: Settings, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Which span exporters the settings and the standard ``OTEL_*`` variables ask for: ``otlp``, ``console``,
    ``trace_dir``; [] when tracing is off. An OTLP endpoint (``RLENS_OTEL_ENDPOINT`` or the SDK's own) turns OTLP on,
    unless ``OTEL_TRACES_EXPORTER`` says otherwise; ``OTEL_SDK_DISABLED=true`` turns everything off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    endpoint = bool(
        settings.service.otel_endpoint
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    named = [e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    unknown = sorted(set(named) - {"otlp", "console", "none"})
    if unknown:
        raise ValueError(
            f"OTEL_TRACES_EXPORTER: unknown exporter(s) {', '.join(unknown)}; rlens knows otlp, console, none"
        )
    chosen = [e for e in named if e != "none"] if named else (["otlp"] if endpoint else [])
    if settings.service.trace_dir is not None:
        chosen.append("trace_dir")
    return chosen


def setup_tracing(settings: Settings, role: str, environ: Mapping[str, str] = os.environ) -> None:
    """The process's tracer provider, when traces are configured (:func:`exporters`)."""
    chosen = exporters(settings, environ)
    if not chosen:
        return
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    attributes = {"service.namespace": "rlens", "rlens.role": role}
    named = environ.get("OTEL_SERVICE_NAME") or "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if not named:  # the operator's service name wins (Resource.create merges ours last)
        attributes[SERVICE_NAME] = f"rlens-{role}"
    provider = TracerProvider(resource=Resource.create(attributes))  # the sampler from OTEL_TRACES_SAMPLER
    if "trace_dir" in chosen:
        path = Path(settings.service.trace_dir or ".") / f"{role}-{os.getpid()}.jsonl"
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    if "console" in chosen:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    if "otlp" in chosen:
        provider.add_span_processor(BatchSpanProcessor(otlp_exporter(settings, environ)))
    trace.set_tracer_provider(provider)
    global _enabled
    _enabled = True


def otlp_exporter(settings: Settings, environ: Mapping[str, str]) -> SpanExporter:
    """The OTLP/HTTP span exporter: to ``RLENS_OTEL_ENDPOINT`` if set, else where the SDK's variables say (it reads
    ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, ``_HEADERS``, ``_TIMEOUT``, ``_COMPRESSION`` and ``_CERTIFICATE``)."""
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol not in PROTOCOLS:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: rlens exports traces over {', '.join(PROTOCOLS)} only"
        )
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ValueError("exporting traces over OTLP needs the OTLP exporter: pip install 'rlens[otel]'") from None
    return (
        OTLPSpanExporter(endpoint=settings.service.otel_endpoint)
        if settings.service.otel_endpoint
        else OTLPSpanExporter()
    )


def model_span_attributes(pool: PoolConfig) -> dict[str, dict[str, str | int]]:
    """Per pool model, the attributes of its call spans that the pool file knows: the provider (its backend), the
    model the server serves, and the server's address and port (``openai`` models)."""
    attributes: dict[str, dict[str, str | int]] = {}
    for m in pool.models:
        own: dict[str, str | int] = {"gen_ai.provider.name": m.backend, "gen_ai.response.model": m.name}
        if m.backend == "openai":
            url = urlsplit(str(m.options.get("base_url", "")))
            own["gen_ai.response.model"] = str(m.options.get("model", m.name))
            if url.hostname:
                own["server.address"] = url.hostname
                own["server.port"] = url.port or (443 if url.scheme == "https" else 80)
        attributes[m.name] = own
    return attributes


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


def link_to(traceparent: str) -> None:
    """Link the current span to the span of ``traceparent`` (a W3C value; nothing without a valid one)."""
    other = trace.get_current_span(context_of_traceparent(traceparent)).get_span_context()
    if other.is_valid:
        trace.get_current_span().add_link(other)


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
