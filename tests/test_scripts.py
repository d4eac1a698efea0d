"""``scripts/under_load.sh``: a command beside busy processes, its exit status passed on, the load it ran at reported."""

import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "under_load.sh"
SUMMARY = re.compile(
    r"under load: 2 busy processes, exit (\d+) after \d+ s; "
    r"1-minute load min / median / max: ([\d.]+) / ([\d.]+) / ([\d.]+) \((\d+) readings\)"
)


COUNT_BUSY = """
import os
def command(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:  # ended meanwhile
        return b""
print(sum(command(pid) == b"python3\\0-c\\0while True: pass\\0" for pid in os.listdir("/proc") if pid.isdigit()))
"""  # how many of the script's busy processes run now (read from /proc: no procps needed)


def _busy_processes() -> int:
    return int(subprocess.run(["python3", "-c", COUNT_BUSY], capture_output=True, text=True, check=True).stdout)


def _under_load(*command: str) -> subprocess.CompletedProcess:
    environment = os.environ | {"LOAD_INTERVAL": "0.2"}
    return subprocess.run(["bash", str(SCRIPT), "2", *command], capture_output=True, text=True, env=environment, timeout=60)


def test_the_command_runs_beside_busy_processes_and_its_status_and_load_are_reported():
    before = _busy_processes()
    done = _under_load("bash", "-c", f"python3 -c '{COUNT_BUSY}'; sleep 1; exit 3")
    assert done.returncode == 3
    lines = done.stdout.splitlines()
    assert int(lines[0]) == before + 2  # the command saw both busy processes
    summary = SUMMARY.fullmatch(lines[-1])
    assert summary, lines[-1]
    status, low, middle, high, readings = summary.groups()
    assert status == "3" and float(low) <= float(middle) <= float(high) and int(readings) >= 3
    time.sleep(0.5)
    assert _busy_processes() == before  # none left behind


def test_a_bad_count_is_refused_with_the_usage():
    done = subprocess.run(["bash", str(SCRIPT), "many", "true"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "BUSY: how many busy processes, a whole number" in done.stderr
