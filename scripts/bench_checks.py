"""Wall time and peak memory of every command on one checkpoint, start-up included (issue 18).

Runs, as a user would, `--help`, a usage error, `quantize`, `verify`, `verify --against`, `validate` and
`dequantize` as separate processes, polling each one's peak RSS and RssAnon (`process_memory`), and
reads the output once with one thread per core as the rate reference for `verify`.

    python scripts/make_synthetic_mixtral.py /work/bench-data/mixtral-n2 --layers 2
    python scripts/bench_checks.py /work/bench-data/mixtral-n2 --out /work/bench-data/out --json n2.json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-checks-out"))
    parser.add_argument("--device", default="cpu", help="quantize and validate here (cpu or cuda)")
    parser.add_argument("--tokens", type=int, default=64, help="validate's hidden states per layer")
    parser.add_argument("--skip", default="", help="comma-separated steps to leave out, e.g. validate")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    src, dst, back = args.checkpoint, args.out / "fp8", args.out / "bf16-again"
    validate_device = "cpu" if args.device == "cpu" else args.device
    steps = [
        ("--help", CLI + ["--help"], (0,)),
        ("usage error", CLI + ["quantize", "--typo", str(src), str(dst)], (2,)),
        ("quantize", CLI + ["quantize", str(src), str(dst), "--overwrite", "--no-progress",
                            "--device", args.device], (0,)),
        ("verify", CLI + ["verify", str(dst)], (0,)),
        ("verify --against", CLI + ["verify", str(dst), "--against", str(src)], (0,)),
        ("validate", CLI + ["validate", str(src), str(dst), "--no-progress", "--tokens", str(args.tokens),
                            "--device", validate_device], (0,)),
        ("dequantize", CLI + ["dequantize", str(dst), str(back), "--overwrite"], (0,)),
    ]
    skip = set(filter(None, args.skip.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"checkpoint": str(src), "source_bytes": folder_bytes(src), "device": args.device,
               "cores": os.cpu_count(), "steps": {}}
    for name, command, expect in steps:
        if name in skip:
            continue
        results["steps"][name] = run_measured(command, expect=expect)
        if name == "quantize":
            results["output_bytes"] = folder_bytes(dst)
            results["parallel read of output"] = parallel_read(dst, os.cpu_count() or 1)
        print(f"{name:>18}: {results['steps'][name]['seconds']:7.2f} s, peak RSS "
              f"{results['steps'][name]['peak_rss'] / 1e9:6.2f} GB, RssAnon "
              f"{results['steps'][name]['peak_rss_anon'] / 1e9:6.2f} GB", flush=True)
    read = results.get("parallel read of output")
    if read:
        print(f"parallel read of the output: {read['bytes'] / 1e9:.2f} GB in {read['seconds']:.2f} s "
              f"({read['bytes'] / read['seconds'] / 1e9:.2f} GB/s)")
    shutil.rmtree(back, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
