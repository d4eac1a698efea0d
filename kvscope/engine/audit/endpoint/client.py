"""Fidelity measured on the served model: a well-behaved client of an OpenAI-compatible endpoint (vLLM, SGLang,
llama-server, TGI, the OpenAI API), as docs/audit.md describes it ("The client").

Per prompt the endpoint answers one greedy request (temperature 0, ``N`` tokens) with the top-k log-probabilities of
every generated token. Requests in flight are bounded (``concurrency``) and retried with backoff (``Retry-After``
honoured); answers are kept by the hash of their request (route and body, never the key) in a JSONL file, so a run
resumes and no request is sent twice. The API key is read from ``KVSCOPE_ENDPOINT_KEY``, sent only as a header, never
written. Requests of one lane (a session) go in order, pinned to a llama-server slot or named by ``X-Session-ID``.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvscope.engine.audit.endpoint.answers import Answer, EndpointError, Probe, read_answer
from kvscope.engine.audit.report.records import Record
from kvscope.engine.audit.simulate.registry import engine_of_owner
from kvscope.engine.errors import Unreachable
from kvscope.engine.progress import StepProgress

KEY_ENV = "KVSCOPE_ENDPOINT_KEY"  # the environment variable the API key is read from
DEFAULT_TOP_K = 20  # the OpenAI API's most; vLLM's --max-logprobs default
DEFAULT_CONCURRENCY = 4
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_RETRIES = 5
SESSION_HEADER = "X-Session-ID"
SEND_MODES = ("auto", "tokens", "chat")
TOKEN_SERVERS = ("llamacpp", "vllm", "sglang")  # ``owned_by`` of servers whose /v1/completions takes token ids
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_MAX_WAIT_S = 60.0


KL_BOUND_WORDS = (
    "kl ≤ exact KL ≤ kl + kl_bound; kl_bound = tail_mass · max(0, M + log(Q_T/P_T)), M the largest log-ratio "
    "the top-k lists show, assumed to hold in the tail (docs/audit.md)"
)


@dataclass(frozen=True)
class EndpointDescription(Record):
    """The endpoint as the report names it (never its key)."""

    url: str
    model: str | None
    served_by: str | None
    sent_as: str | None
    top_k: int
    kl_bound: str = field(default=KL_BOUND_WORDS, init=False)  # what the KL's bound means
    cache_file: str | None


class EndpointUnreachable(EndpointError, Unreachable):
    """Nothing listens at the endpoint: refused at once, never retried."""


@dataclass(frozen=True)
class EndpointSettings:
    """Where to measure and how the client behaves."""

    url: str  # the base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str | None = None  # None: the one model the server lists
    top_k: int = DEFAULT_TOP_K
    concurrency: int = DEFAULT_CONCURRENCY
    timeout_s: float = DEFAULT_TIMEOUT_S
    retries: int = DEFAULT_RETRIES
    backoff_s: float = 1.0  # the first retry's wait; doubled each time
    cache_path: Path | None = None  # the JSONL of answers kept by request hash
    send: str = "auto"  # tokens: the audited token ids on /v1/completions; chat: messages; auto: tokens where the server takes them
    key_env: str = KEY_ENV

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise EndpointError(f"--endpoint {self.url!r}: give an http:// or https:// base URL")
        if self.send not in SEND_MODES:
            raise EndpointError(f"send {self.send!r}: choose one of {', '.join(SEND_MODES)}")
        for name, value in (("top_k", self.top_k), ("concurrency", self.concurrency)):
            if value < 1:
                raise EndpointError(f"endpoint {name} must be at least 1, got {value}")

    @property
    def base(self) -> str:
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class Server:
    """What the endpoint said about itself: the model it serves, who serves it, how prompts are sent, and its slots."""

    model: str
    owned_by: str
    tokens: bool  # prompts go as token ids on /v1/completions (else as chat messages)
    slots: int | None  # llama-server's parallel slots (sessions are pinned to them)

    @property
    def sent_as(self) -> str:
        if self.tokens:
            return "token ids on /v1/completions: the server sees exactly the audited tokens"
        return "chat messages on /v1/chat/completions: the chat template is then the server's, not the audited one"

    @property
    def simulated_engine(self) -> str:
        """The simulated cache (``registry.ENGINES``) the server's own cache is set beside."""
        return engine_of_owner(self.owned_by)


# ---------------------------------------------------------------------------------------------------- the client
def request_key(base: str, model: str, probe: Probe) -> str:
    """The hash an answer is kept by: the endpoint, the model, the route and the body (never a header)."""
    text = json.dumps({"base": base, "model": model, "route": probe.route, "body": probe.body}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class AnswerCache:
    """Answers kept by request hash in a JSONL file (one ``{"key", "response"}`` a line), appended as they arrive."""

    def __init__(self, path: Path | None) -> None:
        self.path, self.responses = path, {}
        if path is not None and path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                    self.responses[item["key"]] = item["response"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut short by an interrupted run: that request is sent again

    def put(self, key: str, response: dict) -> None:
        self.responses[key] = response
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as out:
                out.write(json.dumps({"key": key, "response": response}) + "\n")


@dataclass
class EndpointClient:
    """An OpenAI-compatible endpoint, checked (``connect``) before any probe is answered (``answer``)."""

    settings: EndpointSettings
    transport: httpx.AsyncBaseTransport | None = None  # tests pass a fake server
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)
    sent: int = 0  # requests sent (answers taken from the cache are not)
    server: Server | None = None
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # the wait between tries

    def __post_init__(self) -> None:
        self.cache = AnswerCache(self.settings.cache_path)

    def _headers(self) -> dict[str, str]:
        key = self.environ.get(self.settings.key_env)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _client(self) -> httpx.AsyncClient:
        timeout = httpx.Timeout(self.settings.timeout_s, connect=min(self.settings.timeout_s, 10.0))
        limits = httpx.Limits(max_connections=self.settings.concurrency)
        return httpx.AsyncClient(
            base_url=self.settings.base, headers=self._headers(), timeout=timeout, limits=limits, transport=self.transport, trust_env=False
        )

    def describe(self) -> EndpointDescription:
        """The endpoint as the JSON names it (never the key)."""
        server, settings = self.server, self.settings
        return EndpointDescription(
            settings.base,
            server.model if server else settings.model,
            server.owned_by if server else None,
            server.sent_as if server else None,
            settings.top_k,
            str(settings.cache_path) if settings.cache_path else None,
        )

    def connect(self) -> Server:
        """The server's own description, refused by name when it does not serve the model asked for."""
        if self.server is None:
            self.server = asyncio.run(self._connect())
        return self.server

    async def _connect(self) -> Server:
        async with self._client() as client:
            listed = await self._send(client, "GET", "/v1/models", None, {})
            models = [item for item in listed.get("data") or [] if isinstance(item, dict) and isinstance(item.get("id"), str)]
            names = [item["id"] for item in models]
            wanted = self.settings.model or (names[0] if len(names) == 1 else None)
            if wanted is None:
                raise EndpointError(
                    f"{self.settings.base} serves {len(names)} models ({', '.join(names[:8])}): name one with --endpoint-model"
                )
            if wanted not in names:
                raise EndpointError(
                    f"{self.settings.base} serves {', '.join(names) or 'no model'}, not {wanted}: "
                    "point --endpoint at the server of the audited model or correct --endpoint-model"
                )
            owned_by = str(next(item for item in models if item["id"] == wanted).get("owned_by") or "unknown")
            tokens = self.settings.send == "tokens" or (self.settings.send == "auto" and owned_by in TOKEN_SERVERS)
            slots = None
            if owned_by == "llamacpp":
                props = await self._send(client, "GET", "/props", None, {})
                slots = int(props.get("total_slots") or 1)
            return Server(wanted, owned_by, tokens, slots)

    def answer(self, probes: Sequence[Probe], progress: StepProgress = None) -> list[Answer]:
        """Every probe answered, in order: from the answer cache where its hash is kept, else sent (an identical probe
        once). Lanes run side by side, at most ``concurrency`` requests in flight."""
        server = self.connect()
        keys = [request_key(self.settings.base, server.model, probe) for probe in probes]
        responses = asyncio.run(self._answer_all(server, probes, keys, progress))
        return [
            read_answer(response, f"{server.owned_by} at {self.settings.base} ({probe.route})")
            for probe, response in zip(probes, responses)
        ]

    async def _answer_all(self, server: Server, probes: Sequence[Probe], keys: list[str], progress: StepProgress) -> list[dict]:
        lanes: dict[str | None, list[int]] = {}
        for index, probe in enumerate(probes):
            lanes.setdefault(probe.lane, []).append(index)
        slot_of = {lane: number % server.slots for number, lane in enumerate(lanes)} if server.slots else {}
        gate, pending = asyncio.Semaphore(self.settings.concurrency), {}
        done = 0

        async def one(client: httpx.AsyncClient, index: int) -> None:
            nonlocal done
            key, probe = keys[index], probes[index]
            if key not in self.cache.responses:
                if key in pending:  # the same request already on its way in another lane
                    await pending[key].wait()
                else:
                    pending[key] = asyncio.Event()
                    body = {"model": server.model, **probe.body}
                    headers = {}
                    if probe.lane is not None:
                        headers[SESSION_HEADER] = probe.lane
                    if server.owned_by == "llamacpp" and probe.route == COMPLETIONS:
                        body |= {"id_slot": slot_of[probe.lane], "cache_prompt": True}
                    async with gate:
                        response = await self._send(client, "POST", probe.route, body, headers)
                    self.sent += 1
                    read_answer(response, f"{server.owned_by} at {self.settings.base} ({probe.route})")  # refuse early, by name
                    self.cache.put(key, response)
                    pending[key].set()
            done += 1
            if progress:
                progress(done, len(probes))

        async def lane(client: httpx.AsyncClient, indices: list[int]) -> None:
            for index in indices:
                await one(client, index)

        async with self._client() as client:
            await asyncio.gather(*(lane(client, indices) for indices in lanes.values()))
        return [self.cache.responses[key] for key in keys]

    async def _send(self, client: httpx.AsyncClient, method: str, route: str, body: dict | None, headers: dict) -> dict:
        """One request, retried with backoff on 429, 5xx and transport errors (``Retry-After`` honoured)."""
        settings, problem = self.settings, ""
        for attempt in range(settings.retries + 1):
            wait = settings.backoff_s * 2**attempt
            try:
                response = await client.request(method, route, json=body, headers=headers)
            except httpx.ConnectError as error:  # refused, or no such host: final, nothing to wait for
                why = error or "connection refused"
                raise EndpointUnreachable(
                    f"nothing answers at {settings.base} ({why}): start the server there, or correct the URL (--endpoint)"
                ) from None
            except httpx.TransportError as error:
                problem = f"{type(error).__name__}: {error}"
            else:
                if response.status_code == 429 or response.status_code >= 500:
                    problem = f"HTTP {response.status_code}: {response.text[:200]}"
                    wait = retry_after(response.headers.get("Retry-After")) or wait
                elif response.status_code >= 400:
                    raise EndpointError(f"{settings.base}{route} answered HTTP {response.status_code}: {response.text[:300]}")
                else:
                    try:
                        return response.json()
                    except json.JSONDecodeError:
                        raise EndpointError(f"{settings.base}{route} answered something other than JSON: {response.text[:200]!r}") from None
            if attempt < settings.retries:
                await self.sleep(min(wait, _MAX_WAIT_S))
        raise EndpointError(f"{settings.base}{route} failed {settings.retries + 1} times; the last: {problem}")


def retry_after(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (a number or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)
