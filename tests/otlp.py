"""An OTLP/HTTP trace receiver for the tests: ``POST /v1/traces`` with an ``ExportTraceServiceRequest`` (protobuf,
decoded by the OpenTelemetry project's own ``opentelemetry-proto`` classes, as a collector does), answered as the
protocol says; every span received is kept as a plain dict (name, ids, times, attributes, resource)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(pairs) -> dict:
    return {a.key: _value(a.value) for a in pairs}


class OtlpReceiver:
    """Listens on 127.0.0.1 (a free port) until :meth:`close`; ``spans`` grows as exports arrive."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404 if self.path != "/v1/traces" else 415)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest.FromString(body)
                receiver._keep(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _keep(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    spans.append(
                        {
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_id": s.parent_span_id.hex() or None,
                            "start_ns": s.start_time_unix_nano,
                            "end_ns": s.end_time_unix_nano,
                            "attributes": _attributes(s.attributes),
                            "status": s.status.code,
                            "resource": resource,
                        }
                    )
        with self.lock:
            self.spans.extend(spans)

    def received(self) -> list[dict]:
        with self.lock:
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
