"""Exports written by the real client libraries, not by hand: each client (its own environment, pins in
``benchmarks/interop/clients/<client>.txt``) sends the same chat sessions to the pinned llama-server, and its export
is stored beside the server's raw answers, for the tests to read as a user would upload them.

    bash scripts/build_llama_server.sh && bash scripts/client_envs.sh       # once
    python -m benchmarks.interop.client_exports [--clients otel-2.3b0,otel-2.4b0,litellm,langfuse,langfuse-5,helicone]

``SESSIONS``: three chats of four turns, sent interleaved at temperature 0, each reply fed back; in the first the
customer's tier changes (gold → silver) from turn 3, a field edit the audit must find. Every client gets a fresh
llama-server with its defaults (4 slots, one KV cache, the RAM prompt cache), as a client that names no slot meets it.
A recording proxy in front of the server keeps each chat request and the server's answer, exactly as sent and
answered. Writes, per client, demos/logs/exports/clients/<client>.jsonl (the export) and <client>.answers.json
(the client's pins, the server's settings, and every call: ``request`` and ``response``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from benchmarks.common import free_port
from benchmarks.serving.serving_servers import SERVER_BINARY, LlamaServer, embedded_gguf

ROOT = Path(__file__).resolve().parents[2]
# the environment: the client.py kind
CLIENTS = {
    "otel-2.3b0": "otel",
    "otel-2.4b0": "otel",
    "litellm": "litellm",
    "langfuse": "langfuse",
    "langfuse-5": "langfuse",
    "helicone": "helicone",
}
EXPORTS = ROOT / "demos" / "logs" / "exports" / "clients"
SUPPORT = "You are the help desk of Northwind Traders.\nCustomer tier: {tier}\nAnswer in one short paragraph."
SESSIONS = (
    {
        "id": "support-4417",
        "systems": [SUPPORT.format(tier=tier) for tier in ("gold", "gold", "silver", "silver")],
        "users": ["Where is my order 4417?", "Can you change the address?", "Is express shipping free for me?", "Thanks, bye."],
        "max_tokens": 24,
    },
    {
        "id": "tutor-lists",
        "systems": ["You are a Python tutor. Keep answers brief and show code when it helps."] * 4,
        "users": ["What is a list comprehension?", "Show one that squares numbers.", "Now keep only the even ones.", "Done."],
        "max_tokens": 48,
    },
    {
        "id": "travel-lisbon",
        "systems": ["You are a travel assistant. Reply in at most two sentences."] * 4,
        "users": ["Plan a day in Lisbon.", "Add a museum.", "Where should I eat dinner?", "Great."],
        "max_tokens": 24,
    },
)


class RecordingProxy:
    """A loopback HTTP proxy in front of ``upstream`` that forwards every request and keeps each chat completion's
    request body and answer, in arrival order."""

    def __init__(self, upstream: str) -> None:
        self.upstream, self.calls, self.base_url = upstream, [], ""
        self._server: ThreadingHTTPServer | None = None

    def __enter__(self) -> RecordingProxy:
        proxy = self

        class Forward(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with httpx.Client(trust_env=False, timeout=600.0) as client:
                    headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
                    answer = client.request(method, proxy.upstream + self.path, content=body, headers=headers)
                if method == "POST" and self.path.endswith("/chat/completions"):
                    proxy.calls.append({"request": json.loads(body), "response": answer.json()})
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

            def log_message(self, *args) -> None:
                pass

        port = free_port()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), Forward)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def client_pythons(clients: list[str]) -> dict[str, str]:
    """Each client's environment, installed once by scripts/client_envs.sh: its python."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "client_envs.sh"), *clients], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"scripts/client_envs.sh failed:\n{done.stderr[-3000:]}")
    return dict(zip(clients, done.stdout.split(), strict=True))


def record_client(client: str, python: str, gguf: Path, threads: int, out: Path) -> dict:
    """One client's sessions on a fresh llama-server: its export written to ``out``; the answers file's content."""
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "llama-server.log"
        with LlamaServer(SERVER_BINARY, gguf, 8192, threads, log, model="embedded", slots=None, cache_ram_mib=None) as server:
            with RecordingProxy(server.base_url) as proxy:
                plan = Path(scratch) / "plan.json"
                plan.write_text(json.dumps({"base_url": proxy.base_url, "model": "embedded", "sessions": SESSIONS}))
                command = [python, str(Path(__file__).parent / "clients" / "client.py"), CLIENTS[client], str(plan), str(out)]
                done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
                if done.returncode != 0:
                    raise SystemExit(f"{client} failed:\n{done.stderr[-4000:]}")
            settings = server.settings()
    pins = (Path(__file__).parent / "clients" / f"{client}.txt").read_text().splitlines()
    return {
        "client": client,
        "pins": [line for line in pins if line and not line.startswith("#")],
        "server": settings,
        "sessions": [session["id"] for session in SESSIONS],
        "calls": proxy.calls,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated, of " + ", ".join(CLIENTS))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    clients = [name.strip() for name in args.clients.split(",") if name.strip()]
    unknown = sorted(set(clients) - set(CLIENTS))
    if unknown:
        parser.error(f"unknown clients {unknown}: choose from {', '.join(CLIENTS)}")
    pythons, gguf = client_pythons(clients), embedded_gguf()
    EXPORTS.mkdir(parents=True, exist_ok=True)
    for client in clients:
        out = EXPORTS / f"{client}.jsonl"
        answers = record_client(client, pythons[client], gguf, args.threads, out)
        (EXPORTS / f"{client}.answers.json").write_text(json.dumps(answers, indent=1) + "\n")
        lines = len(out.read_text().splitlines())
        print(f"{client}: {len(answers['calls'])} calls answered, {lines} export lines -> {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
