"""Time quantize-moe against llm-compressor's `model_free_ptq` and against the disk, and print a table.

Every run is a separate process on a warm page cache (each checkpoint is read
once before its runs, and our imports are run once); wall time and the peak
RSS of that process (from `wait4`) are recorded. Pairs: our per-channel
scheme vs llm-compressor's FP8_DYNAMIC, our block scheme vs its FP8_BLOCK.
llm-compressor runs from its own virtual environment (--llmc-python), never
from this project's. With
--repeat N the two tools take turns N times and the ratios use each one's
median (a shared machine's disk and page cache vary from run to run).

    python3 -m venv .llmc-venv && .llmc-venv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    python scripts/make_synthetic_mixtral.py bench/mixtral-n2 --layers 2    # 6.3 GB (bench/mixtral-n8: --layers 8)
    python scripts/bench_quantize.py bench/mixtral-n2 --llmc-python .llmc-venv/bin/python \\
        --memory bench/mixtral-n8 --out bench/out
    python scripts/bench_quantize.py bench/mixtral-n2 --device cuda --disk-rate     # on a GPU machine

`bench/` stands for any folder with room; the first line makes llm-compressor's venv.

--disk-rate writes as many bytes as our output with plain `dd`s (one with
fsync, one direct, four direct at once), and prints each scheme's median
output rate as a share of what the disk sustains (the fastest of the three).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

LLMC_SCHEME = {"channel": "FP8_DYNAMIC", "block": "FP8_BLOCK"}
LLMC_SNIPPET = ("import sys; from llmcompressor import model_free_ptq; "
                "model_free_ptq(sys.argv[1], sys.argv[2], scheme=sys.argv[3], "
                "ignore=['lm_head', 're:.*embed_tokens$', 're:.*block_sparse_moe.gate$'])")
OURS_SNIPPET = ("import sys; from quantize_moe.plan.plan import Options; from quantize_moe.write.job import "
                "quantize_checkpoint; quantize_checkpoint(sys.argv[1], sys.argv[2], Options(scheme=sys.argv[3]), "
                "overwrite=True, show_progress=False, device=sys.argv[4], workers=int(sys.argv[5]) or None)")


def measure(command: list[str], cwd: str | None = None) -> tuple[float, float, float]:
    """(wall seconds, seconds of the `sync` after it, peak RSS in GB) of one process."""
    os.sync()
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, cwd=cwd)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(command)}")
    os.sync()
    return seconds, time.perf_counter() - start - seconds, usage.ru_maxrss * 1024 / 1e9


def median(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """Median wall seconds and median peak RSS of several runs."""
    return statistics.median(s for s, _ in runs), statistics.median(r for _, r in runs)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def warm(folder: Path) -> None:
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as f:
            while f.read(1 << 26):
                pass


def warm_imports(device: str) -> None:
    """Import what a run imports once, so that no timed run pays for reading torch's libraries from disk."""
    modules = "quantize_moe.write.job" + (", quantize_moe.quantization.cuda" if device != "cpu" else "")
    subprocess.run([sys.executable, "-c", f"import {modules}"], check=True)


def ours(src: Path, dst: Path, scheme: str, device: str, workers: int) -> list[str]:
    return [sys.executable, "-c", OURS_SNIPPET, str(src), str(dst), scheme, device, str(workers)]


DD_BLOCK_BYTES = 64 << 20
# (flags, parallel streams): one stream flushed at the end, one written direct, and four direct streams
# into four files at once (a disk behind a queue of requests may take more than one stream gives it).
DD_MODES = {"with fsync": (["conv=fsync"], 1), "direct": (["oflag=direct"], 1),
            "direct, 4 streams": (["oflag=direct"], 4)}


def disk_rate(dst: Path, nbytes: int, flags: list[str], streams: int) -> float:
    """GB/s of plain sequential writes of `nbytes` in all into `dst` by `streams` `dd`s at once, with `flags`."""
    blocks = -(-nbytes // (DD_BLOCK_BYTES * streams))
    targets = [dst / f"dd-{i}.bin" for i in range(streams)]
    os.sync()
    start = time.perf_counter()
    writers = [subprocess.Popen(["dd", "if=/dev/zero", f"of={target}", f"bs={DD_BLOCK_BYTES}", f"count={blocks}",
                                 *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for target in targets]
    if any([writer.wait() for writer in writers]):  # a list: wait for every one
        raise SystemExit(f"dd into {dst} failed")
    seconds = time.perf_counter() - start
    for target in targets:
        target.unlink()
    return blocks * DD_BLOCK_BYTES * streams / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-quantize-out"))
    parser.add_argument("--schemes", default="channel,block")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=0, help="0: the engine's default")
    parser.add_argument("--llmc-python", help="python of a virtual environment with llmcompressor")
    parser.add_argument("--memory", type=Path, nargs="*", default=[],
                        help="larger checkpoints to quantize too (peak RSS must not grow with the model)")
    parser.add_argument("--disk-rate", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each tool and scheme, taking turns")
    args = parser.parse_args()

    table = Table(title=f"quantize {args.checkpoint.name} ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    for column in ("tool", "scheme", "device", "run", "input GB", "wall s", "input GB/s", "output GB/s", "+ sync s",
                   "peak RSS GB"):
        table.add_column(column)
    input_bytes = folder_bytes(args.checkpoint)

    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    on_disk_after: dict[tuple[str, str], list[float]] = {}  # wall + sync: when the output is on disk

    def add(tool, scheme, device, source_bytes, measured, dst):
        seconds, sync, rss = measured
        out_bytes = folder_bytes(dst)
        runs.setdefault((tool, scheme), []).append((seconds, rss))
        on_disk_after.setdefault((tool, scheme), []).append(seconds + sync)
        table.add_row(tool, scheme, device, str(len(runs[tool, scheme])), f"{source_bytes / 1e9:.2f}", f"{seconds:.1f}",
                      f"{source_bytes / seconds / 1e9:.2f}", f"{out_bytes / seconds / 1e9:.2f}", f"{sync:.1f}",
                      f"{rss:.2f}")
        Console(stderr=True).print(f"{tool} {scheme} {device}: {seconds:.1f} s, {rss:.2f} GB")
        return out_bytes

    warm(args.checkpoint)
    warm_imports(args.device)
    output_bytes: dict[str, int] = {}
    for scheme in args.schemes.split(","):
        for _ in range(args.repeat):
            dst = args.out / f"ours-{scheme}"
            measured = measure(ours(args.checkpoint, dst, scheme, args.device, args.workers))
            output_bytes[scheme] = add("quantize-moe", scheme, args.device, input_bytes, measured, dst)
            shutil.rmtree(dst)
            if args.llmc_python:
                dst = args.out / f"llmc-{scheme}"
                measured = measure([args.llmc_python, "-c", LLMC_SNIPPET, str(args.checkpoint), str(dst),
                                    LLMC_SCHEME[scheme]], cwd="/")  # our kernels/ folder would shadow HF's `kernels`
                add("llm-compressor", LLMC_SCHEME[scheme], "cpu", input_bytes, measured, dst)
                shutil.rmtree(dst)
    for folder in args.memory:
        scheme = args.schemes.split(",")[0]
        dst = args.out / f"ours-{folder.name}"
        measured = measure(ours(folder, dst, scheme, args.device, args.workers))
        add("quantize-moe", f"{scheme} ({folder.name})", args.device, folder_bytes(folder), measured, dst)
        shutil.rmtree(dst)
    Console(width=160).print(table)
    for scheme in args.schemes.split(","):
        ours_runs, theirs = runs.get(("quantize-moe", scheme)), runs.get(("llm-compressor", LLMC_SCHEME[scheme]))
        if ours_runs and theirs:
            (our_s, our_rss), (their_s, their_rss) = median(ours_runs), median(theirs)
            print(f"{scheme}: median {our_s:.1f} s vs {their_s:.1f} s: {their_s / our_s:.1f}x the throughput of "
                  f"llm-compressor {LLMC_SCHEME[scheme]}, at {our_rss / their_rss:.2f}x its peak RSS")
    if args.disk_rate:
        args.out.mkdir(parents=True, exist_ok=True)
        nbytes = max(output_bytes.values())
        rates = {mode: disk_rate(args.out, nbytes, *how) for mode, how in DD_MODES.items()}
        for mode, rate in rates.items():
            print(f"dd of {nbytes / 1e9:.2f} GB {mode}: {rate:.2f} GB/s")
        sustained = max(rates.values())
        for scheme in args.schemes.split(","):
            rate = output_bytes[scheme] / statistics.median(on_disk_after[("quantize-moe", scheme)]) / 1e9
            print(f"{scheme} on {args.device}: median {rate:.2f} GB/s of output end to end (until synced), "
                  f"{rate / sustained:.0%} of the disk's sustained {sustained:.2f} GB/s")


if __name__ == "__main__":
    main()
