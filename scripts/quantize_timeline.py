"""Where the wall time of one quantize run goes: its phases and the engine's busy time per worker.

Wraps the orchestrator's and the engine's functions with timers (nothing in the
package is changed on disk) and runs `quantize_checkpoint` once:

    python scripts/quantize_timeline.py SRC DST --scheme channel --device cuda [--workers N] [--no-write-behind]

For each wrapped function it prints how often it ran, the time spent in it summed
over threads, and when (seconds after the imports) it first started and last
ended; "first item to last item" is the engine's own span, against which the
output's bytes give its rate.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

from quantize_moe.write import job, manifest, pipeline, shard_file  # noqa: E402
from quantize_moe.plan.plan import Options  # noqa: E402

IMPORTED = time.perf_counter()
WRAPPED = [(job, "make_plan"), (job, "check_free_space"), (job, "copy_extra_files"),
           (pipeline, "Worker"), (pipeline, "process"), (pipeline, "read_into"), (shard_file.ShardFile, "copy_from"),
           (shard_file.ShardFile, "write"), (shard_file, "write_all_at"), (manifest.Manifest, "record"),
           (manifest.Manifest, "finish")]
WRAPPED_CONTEXTS = [(shard_file, "written_behind")]  # timed from entering the with-block to leaving it


def timed(function, name: str, events: list):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            events.append((name, threading.current_thread().name, start - IMPORTED, time.perf_counter() - IMPORTED))
    return wrapper


def timed_context(function, name: str, events: list):
    @contextlib.contextmanager
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            with function(*args, **kwargs):
                yield
        finally:
            events.append((name, threading.current_thread().name, start - IMPORTED, time.perf_counter() - IMPORTED))
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--scheme", default="channel")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--no-write-behind", action="store_true", help="leave every write in the page cache")
    args = parser.parse_args()

    events: list = []
    for wrap, wrapped in ((timed, WRAPPED), (timed_context, WRAPPED_CONTEXTS)):
        for owner, name in wrapped:
            setattr(owner, name, wrap(getattr(owner, name), name, events))
    if args.no_write_behind:
        shard_file.written_behind = lambda fd, offset, count: contextlib.nullcontext()
    summary = job.quantize_checkpoint(args.src, args.dst, Options(scheme=args.scheme), overwrite=True,
                                               show_progress=False, device=args.device, workers=args.workers)
    print(f"import {IMPORTED - START:.2f} s, quantize_checkpoint {summary.seconds:.2f} s")
    spans = collections.defaultdict(lambda: [0.0, 0, float("inf"), 0.0])
    for name, _, start, end in events:
        span = spans[name]
        span[0] += end - start
        span[1] += 1
        span[2], span[3] = min(span[2], start), max(span[3], end)
    for name, (total, count, first, last) in sorted(spans.items(), key=lambda item: item[1][2]):
        print(f"  {name:18s} x{count:<4d} busy {total:6.2f} s   from {first:6.2f} to {last:6.2f} s")
    _, _, first, last = spans["process"]
    written = sum(p.stat().st_size for p in args.dst.glob("*.safetensors"))
    print(f"first item to last item: {last - first:.2f} s, {written / (last - first) / 1e9:.2f} GB/s of output")


if __name__ == "__main__":
    main()
