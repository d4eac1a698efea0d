"""One real client library sends chat sessions to a server and writes its export as that library writes it. Run inside
the client's own environment (``scripts/client_envs.sh``) by ``benchmarks/interop/client_exports.py``; it imports
the standard library and the client only, never KVScope.

    python client.py otel PLAN.json EXPORT.jsonl       # openai + opentelemetry-instrumentation-openai-v2
    python client.py litellm PLAN.json EXPORT.jsonl    # litellm + a CustomLogger callback
    python client.py langfuse PLAN.json EXPORT.jsonl   # langfuse.openai, its OTLP export received on loopback
    python client.py helicone PLAN.json EXPORT.jsonl   # openai + helicone-helpers' HeliconeManualLogger

PLAN.json: ``base_url`` (the server's, ``/v1`` appended here), ``model``, and ``sessions``: each an ``id``, the
``systems`` prompt of each turn (a field may change between turns), the ``users`` turns and ``max_tokens``. The turns
are sent interleaved (turn 1 of every session, then turn 2, ...) at temperature 0, each reply fed back.

- ``otel``: what OpenTelemetry's collector file exporter writes when one exporter serves the traces, logs and metrics
  pipelines: one OTLP/JSON line per export batch (``resourceSpans``, ``resourceLogs`` or ``resourceMetrics``, ids in
  hex). Content capture is on, in the setting the installed instrumentation reads: ``true`` for the older conventions
  (2.3b0: each message a log record), ``SPAN_ONLY`` for the newer (2.4b0, with ``opentelemetry-util-genai``: the
  messages on the span). With the newer, each turn runs inside an ``invoke_agent`` span whose
  ``gen_ai.conversation.id`` is the session, as agent frameworks write it; the older has no session at all.
- ``litellm``: the ``standard_logging_object`` of each successful call, one JSON line each, as a LiteLLM callback
  writes it; the session is sent as ``litellm_session_id``.
- ``langfuse``: Langfuse's SDK (3.x and 5.x alike, built on OpenTelemetry) with its OpenAI integration
  (``langfuse.openai``), each turn inside ``propagate_attributes(session_id=...)``. Its base URL is a loopback endpoint
  standing in for Langfuse's OTLP ingestion (``/api/public/otel/v1/traces``, OTLP/HTTP protobuf): each export request
  it receives is written as one OTLP/JSON line (ids in hex), as a collector's file exporter would write the same spans.
- ``helicone``: Helicone's manual logger (``helicone-helpers``) around the openai client, as its documentation shows it
  (``log_request(provider="openai", ...)``, the session as the ``Helicone-Session-Id`` additional header). Its logging
  endpoint is a loopback stand-in for Helicone's worker: each posted body (``providerRequest``, ``providerResponse``,
  ``timing``) is written as one JSON line. The logger sends ``providerRequest.meta`` empty and the Helicone headers on
  the log request itself; Helicone's worker merges the two, and so does this endpoint: the log request's
  ``Helicone-*`` headers are written into ``meta``.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

Send = Callable[[str, list, int], str]  # (session id, messages, max_tokens) -> the reply's text
Receive = Callable[[str, dict, bytes], None]  # (path, headers, body) of one POST to a stand-in ingestion endpoint


def run_sessions(plan: dict, send: Send) -> None:
    """Every session's turns sent interleaved, each reply appended as the assistant's message before the next turn."""
    histories: dict[str, list] = {session["id"]: [] for session in plan["sessions"]}
    for turn in range(max(len(session["users"]) for session in plan["sessions"])):
        for session in plan["sessions"]:
            if turn >= len(session["users"]):
                continue
            history = histories[session["id"]]
            history.append({"role": "user", "content": session["users"][turn]})
            messages = [{"role": "system", "content": session["systems"][turn]}, *history]
            history.append({"role": "assistant", "content": send(session["id"], messages, session["max_tokens"])})


class _Lines:
    """One file that several exporters append whole lines to (a collector's file exporter), safely across threads."""

    def __init__(self, path: Path) -> None:
        self.path, self.lock = path, threading.Lock()
        path.write_text("")

    def append(self, message) -> None:
        from google.protobuf.json_format import MessageToDict

        line = json.dumps(_hex_ids(MessageToDict(message)), separators=(",", ":"))
        with self.lock, self.path.open("a") as out:
            out.write(line + "\n")


def _hex_ids(value):
    """OTLP/JSON writes trace and span ids in hex, where protobuf's JSON mapping gives base64."""
    if isinstance(value, dict):
        return {
            key: base64.b64decode(item).hex() if key in ("traceId", "spanId", "parentSpanId") and isinstance(item, str) else _hex_ids(item)
            for key, item in value.items()
        }
    return [_hex_ids(item) for item in value] if isinstance(value, list) else value


def run_otel(plan: dict, path: Path) -> None:
    """The openai client instrumented by openai-v2, every signal to one OTLP/JSON lines file."""
    try:
        from opentelemetry.util.genai.handler import get_telemetry_handler
    except ImportError:  # 2.3b0 and older: the older conventions, content capture as a boolean
        get_telemetry_handler = None
    os.environ["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = "true" if get_telemetry_handler is None else "SPAN_ONLY"
    os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental")
    import openai
    from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExporter, LogRecordExportResult
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    lines = _Lines(path)

    class Spans(SpanExporter):
        def export(self, spans):
            lines.append(encode_spans(spans))
            return SpanExportResult.SUCCESS

    class Logs(LogRecordExporter):
        def export(self, batch):
            lines.append(encode_logs(batch))
            return LogRecordExportResult.SUCCESS

        def force_flush(self, timeout_millis=30_000):
            return True

        def shutdown(self):
            pass

    class Metrics(MetricExporter):
        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            lines.append(encode_metrics(metrics_data))
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kwargs):
            pass

    resource = Resource.create({"service.name": "kvscope-client-exports"})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(Spans()))
    logger_provider = LoggerProvider(resource=resource)
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(Logs()))
    meter_provider = MeterProvider(
        resource=resource, metric_readers=[PeriodicExportingMetricReader(Metrics(), export_interval_millis=60_000)]
    )
    providers = {"tracer_provider": tracer_provider, "logger_provider": logger_provider, "meter_provider": meter_provider}
    OpenAIInstrumentor().instrument(**providers)
    client = openai.OpenAI(base_url=plan["base_url"] + "/v1", api_key="not-needed", max_retries=0)
    agents = get_telemetry_handler(**providers) if get_telemetry_handler else None

    def chat(messages: list, max_tokens: int) -> str:
        answer = client.chat.completions.create(model=plan["model"], messages=messages, max_tokens=max_tokens, temperature=0.0)
        return answer.choices[0].message.content or ""

    def send(session: str, messages: list, max_tokens: int) -> str:
        if agents is None:
            return chat(messages, max_tokens)
        with agents.invoke_local_agent(agent_name="support-desk", request_model=plan["model"]) as agent:
            agent.conversation_id = session
            return chat(messages, max_tokens)

    run_sessions(plan, send)
    for provider in (tracer_provider, logger_provider, meter_provider):
        provider.shutdown()  # flushes every batch to the file


def run_litellm(plan: dict, path: Path) -> None:
    """LiteLLM's SDK against the OpenAI-compatible server, a CustomLogger writing each standard logging payload."""
    import litellm
    from litellm.integrations.custom_logger import CustomLogger

    path.write_text("")

    class Payloads(CustomLogger):
        def log_success_event(self, kwargs, response_obj, start_time, end_time):
            with path.open("a") as out:
                out.write(json.dumps(kwargs["standard_logging_object"], default=str) + "\n")

    litellm.callbacks = [Payloads()]

    def send(session: str, messages: list, max_tokens: int) -> str:
        answer = litellm.completion(
            model=f"openai/{plan['model']}",
            api_base=plan["base_url"] + "/v1",
            api_key="not-needed",
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            litellm_session_id=session,
        )
        return answer.choices[0].message.content or ""

    run_sessions(plan, send)
    sent = sum(len(session["users"]) for session in plan["sessions"])
    for _ in range(600):  # LiteLLM runs success callbacks on a worker thread: wait for every call's line
        if len(path.read_text().splitlines()) >= sent:
            return
        time.sleep(0.1)
    raise SystemExit(f"LiteLLM logged {len(path.read_text().splitlines())} of {sent} calls within 60 s")


@contextmanager
def _ingestion(receive: Receive) -> Iterator[str]:
    """A loopback HTTP endpoint standing in for a service's ingestion API: each POST handed to ``receive`` (its
    path, headers and body, gzip undone), answered 200; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            receive(self.path, dict(self.headers), body)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run_langfuse(plan: dict, path: Path) -> None:
    """Langfuse's OpenAI integration, each session's turns under its session id; the SDK's OTLP export requests
    written as OTLP/JSON lines."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    lines = _Lines(path)

    def receive(route: str, headers: dict, body: bytes) -> None:
        lines.append(ExportTraceServiceRequest.FromString(body))

    with _ingestion(receive) as base_url:
        from langfuse import Langfuse, propagate_attributes
        from langfuse.openai import OpenAI

        langfuse = Langfuse(public_key="pk-lf-kvscope", secret_key="sk-lf-kvscope", base_url=base_url)
        client = OpenAI(base_url=plan["base_url"] + "/v1", api_key="not-needed", max_retries=0)

        def send(session: str, messages: list, max_tokens: int) -> str:
            with propagate_attributes(session_id=session):
                answer = client.chat.completions.create(model=plan["model"], messages=messages, max_tokens=max_tokens, temperature=0.0)
            return answer.choices[0].message.content or ""

        run_sessions(plan, send)
        langfuse.shutdown()  # flushes every span to the endpoint


def run_helicone(plan: dict, path: Path) -> None:
    """Helicone's manual logger around the openai client, each posted log written as one JSON line with the log
    request's Helicone headers in ``providerRequest.meta``."""
    import openai
    from helicone_helpers import HeliconeManualLogger

    path.write_text("")
    lock = threading.Lock()

    def receive(route: str, headers: dict, body: bytes) -> None:
        payload = json.loads(body)
        sent = {name: value for name, value in headers.items() if name.lower().startswith("helicone-")}
        payload["providerRequest"]["meta"] = {**payload["providerRequest"].get("meta", {}), **sent}
        with lock, path.open("a") as out:
            out.write(json.dumps(payload, separators=(",", ":")) + "\n")

    with _ingestion(receive) as base_url:
        logger = HeliconeManualLogger(api_key="sk-helicone-kvscope", logging_endpoint=base_url)
        client = openai.OpenAI(base_url=plan["base_url"] + "/v1", api_key="not-needed", max_retries=0)

        def operation(recorder):
            answer = client.chat.completions.create(**recorder.request)
            recorder.append_results(json.loads(answer.to_json()))
            return answer

        def send(session: str, messages: list, max_tokens: int) -> str:
            request = {"model": plan["model"], "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
            headers = {"Helicone-Session-Id": session}
            answer = logger.log_request(provider="openai", request=request, operation=operation, additional_headers=headers)
            return answer.choices[0].message.content or ""

        run_sessions(plan, send)


if __name__ == "__main__":
    kind, plan_path, export_path = sys.argv[1:4]
    run = {"otel": run_otel, "litellm": run_litellm, "langfuse": run_langfuse, "helicone": run_helicone}[kind]
    run(json.loads(Path(plan_path).read_text()), Path(export_path))
