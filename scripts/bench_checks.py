"""Wall time and peak memory of every command on one checkpoint, start-up included (issue 18).

Runs, as a user would, `--help`, a usage error, import plus `make_plan`, `quantize`, `verify`,
`verify --against`, `validate` and `dequantize` as separate processes, polling each one's peak RSS and
RssAnon (`process_memory`), and reads the output, then the source, once with one thread per core: the
rate references for `verify` (the output) and for `verify --against` and `validate` (both). The JSON
holds every step and those ratios, so one command gives the whole of issue 18's table.

    python scripts/make_synthetic_mixtral.py bench/mixtral-n2 --layers 2     # 6.3 GB, in any folder with room
    python scripts/bench_checks.py bench/mixtral-n2 --out bench/out --json n2.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from process_memory import run_measured

CLI = [sys.executable, "-m", "quantize_moe"]
PLAN = ("import sys; from quantize_moe.source.checkpoint import Checkpoint; from quantize_moe.plan.options "
        "import Options; from quantize_moe.plan.plan import make_plan; make_plan(Checkpoint(sys.argv[1]), Options())")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def parallel_read(folder: Path, threads: int) -> dict:
    """Seconds to read every file of `folder` once, files spread over `threads` threads."""
    def read(path: Path) -> int:
        total, buffer = 0, bytearray(16 << 20)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
        return total
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(read, sorted(p for p in folder.rglob("*") if p.is_file())))
    return {"seconds": time.perf_counter() - start, "bytes": nbytes}


def evict(*folders: Path) -> None:
    """Write back and drop the cached pages of every file in `folders` (posix_fadvise), so that a step or
    a reference read starts cold, as on a machine that did not just write or read that checkpoint: a warm
    read of the output made `verify` look faster than reading the output it hashes. Python's own files
    stay cached, as they are for a user's second command. A folder in a tmpfs stays in memory regardless."""
    for folder in folders:
        for path in (p for p in folder.rglob("*") if p.is_file()):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rates(results: dict) -> dict[str, float]:
    """Each check's speed as a fraction of plain parallel reads of what it reads: `verify` the output,
    `verify --against` and `validate` the source and the output (issue 18's targets: 80%, 50%, 50%)."""
    reads = {what: results.get(f"parallel read of {what}") for what in ("output", "source")}
    steps, out = results["steps"], {}
    for name, reads_of in (("verify", ("output",)), ("verify --against", ("output", "source")),
                           ("validate", ("output", "source"))):
        if name in steps and all(reads[what] for what in reads_of):
            out[name] = sum(reads[what]["seconds"] for what in reads_of) / steps[name]["seconds"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-checks-out"))
    parser.add_argument("--device", default="cpu", help="quantize, validate and dequantize here (cpu or cuda)")
    parser.add_argument("--tokens", type=int, default=64, help="validate's hidden states per layer")
    parser.add_argument("--skip", default="", help="comma-separated steps to leave out, e.g. validate")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--cold", action="store_true",
                        help="drop the checkpoints' cached pages before every step and reference read")
    args = parser.parse_args()
    src, dst, back = args.checkpoint, args.out / "fp8", args.out / "bf16-again"
    validate_device = "cpu" if args.device == "cpu" else args.device
    steps = [
        ("--help", CLI + ["--help"], (0,)),
        ("usage error", CLI + ["quantize", "--typo", str(src), str(dst)], (2,)),
        ("import + plan", [sys.executable, "-c", PLAN, str(src)], (0,)),
        ("quantize", CLI + ["quantize", str(src), str(dst), "--overwrite", "--no-progress",
                            "--device", args.device], (0,)),
        ("verify", CLI + ["verify", str(dst)], (0,)),
        ("verify --against", CLI + ["verify", str(dst), "--against", str(src)], (0,)),
        ("validate", CLI + ["validate", str(src), str(dst), "--no-progress", "--tokens", str(args.tokens),
                            "--device", validate_device], (0,)),
        ("dequantize", CLI + ["dequantize", str(dst), str(back), "--overwrite", "--device", args.device], (0,)),
    ]
    skip = set(filter(None, args.skip.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"checkpoint": str(src), "source_bytes": folder_bytes(src), "device": args.device,
               "cores": os.cpu_count(), "checkpoints evicted from the page cache": args.cold, "steps": {}}
    cold = (lambda: evict(*(f for f in (src, dst, back) if f.exists()))) if args.cold else lambda: None
    for name, command, expect in steps:
        if name in skip:
            continue
        cold()
        results["steps"][name] = run_measured(command, expect=expect)
        if name == "quantize":
            results["output_bytes"] = folder_bytes(dst)
            for what, folder in (("output", dst), ("source", src)):
                cold()
                results[f"parallel read of {what}"] = parallel_read(folder, os.cpu_count() or 1)
        print(f"{name:>18}: {results['steps'][name]['seconds']:7.2f} s ({results['steps'][name]['cpu_seconds']:.1f} "
              f"CPU s), peak RSS "
              f"{results['steps'][name]['peak_rss'] / 1e9:6.2f} GB, RssAnon "
              f"{results['steps'][name]['peak_rss_anon'] / 1e9:6.2f} GB", flush=True)
    for what in ("output", "source"):
        if read := results.get(f"parallel read of {what}"):
            print(f"parallel read of the {what}: {read['bytes'] / 1e9:.2f} GB in {read['seconds']:.2f} s "
                  f"({read['bytes'] / read['seconds'] / 1e9:.2f} GB/s)")
    results["rate against reading"] = rates(results)
    for name, ratio in results["rate against reading"].items():
        print(f"{name:>18}: {100 * ratio:.0f}% of the rate of reading what it reads once")
    shutil.rmtree(back, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
