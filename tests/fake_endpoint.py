"""A fake OpenAI-compatible server for the endpoint tests: vLLM's answer shapes, with a tiny model's own torch
log-probs of the token ids it gets (so what the endpoint measures has a ground truth), failures on demand, and counts
of the requests in flight; as an httpx transport or on a real port of 127.0.0.1 (``serving``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import torch


class FakeServer:
    """An OpenAI-compatible server (vLLM's shapes) answering with ``lm``'s torch log-probs of the token ids it gets;
    ``failures`` are (status, Retry-After) answered before the first success, ``refuse_after`` answers 400 once that
    many completions were answered."""

    def __init__(self, lm, model: str = "served", owned_by: str = "vllm", logprobs: bool = True, delay: float = 0.0):
        self.lm, self.model, self.owned_by, self.logprobs, self.delay = lm, model, owned_by, logprobs, delay
        self.failures: list[tuple[int, str | None]] = []
        self.refuse_after: int | None = None
        self.completions: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.lanes_in_flight: dict[str | None, int] = {}
        self.lane_overlap = False
        self.lock = threading.Lock()

    def respond(self, method: str, path: str, body: dict | None, headers: dict) -> tuple[int, dict, dict]:
        self.headers.append({name.lower(): value for name, value in headers.items()})
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": self.owned_by}]}, {}
        if self.failures:
            status, after = self.failures.pop(0)
            return status, {"error": "busy"}, ({"Retry-After": after} if after else {})
        if self.refuse_after is not None and len(self.completions) >= self.refuse_after:
            return 400, {"error": "refused"}, {}
        self.completions.append(body)
        return 200, self.completion(body), {}

    def completion(self, body: dict) -> dict:
        ids, k = list(body["prompt"]), int(body["logprobs"])
        tokens, tops = [], []
        with torch.no_grad():
            for _ in range(body["max_tokens"]):
                logprobs = torch.log_softmax(self.lm.model(torch.tensor([ids])).logits[0, -1].float(), -1)
                top = logprobs.topk(k)
                tops.append({f"token_id:{i}": float(v) for v, i in zip(top.values.tolist(), top.indices.tolist())})
                token = int(logprobs.argmax())
                if token in self.lm.stop_ids:
                    break
                tokens.append(token)
                ids.append(token)
        text = self.lm.tokenizer.decode(tokens)
        logprobs = {"tokens": [f"token_id:{t}" for t in tokens] or ["token_id:1"], "top_logprobs": tops} if self.logprobs else None
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(tokens), "prompt_tokens_details": {"cached_tokens": 0}}
        return {"model": self.model, "choices": [{"text": text, "logprobs": logprobs}], "usage": usage}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        """As an httpx transport: counts requests in flight, overall and per session."""
        lane = request.headers.get("X-Session-ID")
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.lanes_in_flight[lane] = self.lanes_in_flight.get(lane, 0) + 1
            self.lane_overlap |= lane is not None and self.lanes_in_flight[lane] > 1
        try:
            await asyncio.sleep(self.delay)
            body = json.loads(request.content) if request.content else None
            status, data, headers = self.respond(request.method, request.url.path, body, dict(request.headers))
            return httpx.Response(status, json=data, headers=headers)
        finally:
            with self.lock:
                self.in_flight -= 1
                self.lanes_in_flight[lane] -= 1


class _Handler(BaseHTTPRequestHandler):
    fake: FakeServer

    def _answer(self, body: dict | None) -> None:
        status, data, headers = self.fake.respond(self.command, self.path, body, dict(self.headers))
        payload = json.dumps(data).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        self._answer(None)

    def do_POST(self) -> None:
        self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serving(fake: FakeServer) -> Iterator[str]:
    """``fake`` on a free port of 127.0.0.1; its base URL."""
    handler = type("Handler", (_Handler,), {"fake": fake})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
