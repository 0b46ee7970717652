"""Wall time and peak memory of a child process, polled from /proc: peak RSS and peak RssAnon (RSS counts
the pages of mapped shards, which the kernel can drop; RssAnon is what the process really holds)."""

from __future__ import annotations

import os
import resource
import subprocess
import time


def _status_kb(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(line.split()[1]) for line in f for k in keys if line.startswith(k + ":")}
    except (FileNotFoundError, ProcessLookupError):
        return {}


def run_measured(command: list[str], env: dict | None = None, interval: float = 0.01,
                 expect: tuple[int, ...] = (0,)) -> dict:
    """Run `command`; returns wall seconds, CPU seconds (user + system, which other load on a shared
    machine changes far less than the wall time), exit code and peak VmRSS / RssAnon in bytes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    peak = {"VmRSS": 0, "RssAnon": 0}
    while process.poll() is None:
        for key, kb in _status_kb(process.pid, tuple(peak)).items():
            peak[key] = max(peak[key], kb * 1024)
        time.sleep(interval)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    stderr = process.stderr.read().decode(errors="replace")
    if process.returncode not in expect:
        raise RuntimeError(f"{' '.join(command)} exited {process.returncode}: {stderr[-2000:]}")
    return {"seconds": seconds, "cpu_seconds": cpu, "exit_code": process.returncode, "peak_rss": peak["VmRSS"],
            "peak_rss_anon": peak["RssAnon"]}
