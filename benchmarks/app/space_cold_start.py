"""A Space's cold start: a fresh virtualenv from requirements.txt alone, SPACE_ID set, an empty cache.

    python -m benchmarks.app.space_cold_start [--timeout 1800] [--keep DIR]

Creates a virtualenv, installs `requirements.txt` into it (as a Space's build does; nothing else), then starts
`python app.py` from it with `SPACE_ID` set (the public profile) and an empty `KVSCOPE_CACHE_DIR` (the embedded
model is assembled, verified and converted on this first start, and its dtype measured). Measures, from the
moment the server process starts: the first served page (HTTP 200 on /), the first edit of a bundled scenario
through gradio_client (a visitor's first request), and the server's peak resident memory (its children
included) until then. One cold start is one measurement: reps is 1. Writes
benchmarks/app/results/space_cold_start-embedded-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
from gradio_client import Client

from benchmarks.common import ROOT, cpu_info, free_port, results_dir, wait_until_serving
from kvscope.engine.scenario import bundled_scenarios

RESULTS = results_dir(__file__)
SCENARIO = "refund_gate"
STRATEGIES = ["field_only", "erratum"]
SPACE_ID = "kvscope/cold-start-benchmark"


class PeakRss:
    """The largest resident memory of a process and its children, sampled every ``interval`` seconds in a
    daemon thread until :meth:`stop`."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval, self.peak_bytes = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="peak-rss", daemon=True)
        self._thread.start()

    def sample(self) -> int:
        """Resident bytes of the process and its children now (0 once it is gone)."""
        try:
            root = psutil.Process(self.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return total

    def _sample_until_stopped(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.sample())
            self._stop.wait(self.interval)

    def stop(self) -> int:
        """Stop sampling; the peak in bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak_bytes


@dataclass(frozen=True)
class ColdStart:
    """One cold start, in seconds from the server process's start (install: the virtualenv's pip install)."""

    install_s: float
    first_page_s: float
    first_edit_s: float
    edit_s: float  # the first edit alone (its scenario prefilled on the way)
    peak_rss_mb: float
    profile: str  # the hosting profile the server announced


def announced_profile(log: str) -> str | None:
    """The profile name from the server's "KVScope hosting profile: NAME" line, or None."""
    marker = "KVScope hosting profile: "
    return next((line.split(marker, 1)[1].strip() for line in log.splitlines() if marker in line), None)


def make_venv(folder: Path) -> tuple[Path, float]:
    """A fresh virtualenv in ``folder`` with requirements.txt installed: its python and the install's seconds."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    python = folder / "bin" / "python"
    started = time.perf_counter()
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(ROOT / "requirements.txt")], check=True, cwd=ROOT)
    return python, time.perf_counter() - started


def cold_start(python: Path, cache: Path, install_s: float, timeout: float, log_path: Path) -> ColdStart:
    """Start the app from ``python`` as a Space would, then time its first page and its first edit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("KVSCOPE_", "SPACES_", "PYTHON"))} | {
        "SPACE_ID": SPACE_ID,
        "KVSCOPE_CACHE_DIR": str(cache),
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
    with log_path.open("w") as log:
        started = time.perf_counter()
        server = subprocess.Popen([str(python), "app.py", "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        memory = PeakRss(server.pid)
        try:
            wait_until_serving(url, timeout)
            first_page_s = time.perf_counter() - started
            text = bundled_scenarios()[SCENARIO].read_text()
            edit_started = time.perf_counter()
            Client(url, verbose=False).predict(text, None, None, STRATEGIES, 4, -1, api_name="/edit")
            first_edit_s = time.perf_counter() - started
            edit_s = time.perf_counter() - edit_started
        finally:
            peak = memory.stop()
            server.terminate()
            server.wait(timeout=60)
    return ColdStart(
        install_s=round(install_s, 1),
        first_page_s=round(first_page_s, 1),
        first_edit_s=round(first_edit_s, 1),
        edit_s=round(edit_s, 2),
        peak_rss_mb=round(peak / 2**20, 1),
        profile=announced_profile(log_path.read_text()) or "unknown",
    )


def venv_torch(python: Path) -> str:
    """The torch version the virtualenv installed."""
    done = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the first page")
    parser.add_argument("--keep", default=None, help="build the virtualenv and cache here and keep them (default: a temp dir)")
    args = parser.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kvscope-cold-start-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    if cache.exists() and any(cache.iterdir()):
        raise SystemExit(f"{cache} is not empty: a cold start needs an empty cache dir")
    python, install_s = make_venv(work / "venv")
    measured = cold_start(python, cache, install_s, args.timeout, work / "server.log")
    choice = next(iter(json.loads((cache / "dtype-choices.json").read_text()).values()), {})
    output = {
        "model": "embedded",
        "dtype": choice.get("dtype"),
        "dtype_reason": choice.get("reason"),
        "device": "cpu",
        "cpu": cpu_info(),
        "torch": venv_torch(python),
        "python": platform.python_version(),
        "requirements": "requirements.txt",
        "space_id": SPACE_ID,
        "scenario": SCENARIO,
        "strategies": STRATEGIES,
        **asdict(measured),
        "reps": 1,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "space_cold_start-embedded-cpu.json"
    out.write_text(json.dumps(output, indent=2) + "\n")
    print(json.dumps(output, indent=2))


if __name__ == "__main__":
    main()
