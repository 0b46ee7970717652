"""Time `quantize --activations static` (calibration, then quantization) against a dynamic `quantize` of the
same checkpoint, with peak RSS/RssAnon of each (`process_memory`), and compare calibration with issue 17's
speed target: reading the checkpoint once + the calibration forward's FLOPs at half the GPU's bf16 peak.

    python scripts/make_synthetic_mixtral.py /work/bench-data/mixtral-n8 --layers 8 --device cuda
    python scripts/bench_calibrate.py /work/bench-data/mixtral-n8 --samples 256 --length 2048 --device cuda

On the CPU, a 2-layer tiny shape proves the script works:
    python scripts/make_synthetic_mixtral.py /tmp/mixtral-tiny --layers 2 --hidden 256 --expert-width 512 \\
        --experts 4 --vocab 1000
    python scripts/bench_calibrate.py /tmp/mixtral-tiny --samples 8 --length 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench_checks import CLI, folder_bytes, parallel_read
from process_memory import run_measured

H200_BF16_TFLOPS = 989.0  # dense bf16 peak of one H200 SXM


def calibration_flops(config: dict, tokens: int, length: int) -> float:
    """Forward FLOPs of the calibration pass over `tokens` (Mixtral layout): attention projections and
    scores, top-k experts for the hidden states, and every expert's gate/up again for its statistics."""
    hidden, width, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    experts, top_k = config["num_local_experts"], config["num_experts_per_tok"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    per_token = 2 * (2 * hidden * hidden + 2 * hidden * kv)  # q, o and k, v
    per_token += 2 * 2 * hidden * length / 2  # causal scores and values, half the window on average
    per_token += 2 * hidden * experts + top_k * 2 * 3 * hidden * width  # router, routed experts
    per_token += experts * 2 * 2 * hidden * width  # all-experts statistics: every expert's gate/up (w2's input)
    return float(per_token * layers * tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS, help="the GPU's bf16 peak")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-calibrate-out"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    src, config = args.checkpoint, json.loads((args.checkpoint / "config.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "calibration.safetensors"
    ids = torch.randint(0, config["vocab_size"], (args.samples, args.length), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, data)
    common = ["--overwrite", "--no-progress", "--device", args.device, "--scheme", "tensor"]
    results = {"checkpoint": str(src), "source_bytes": folder_bytes(src), "device": args.device,
               "tokens": ids.numel(), "cores": os.cpu_count(),
               "bytes_per_layer": folder_bytes(src) // config["num_hidden_layers"],  # embeddings and head spread in
               "read_source": parallel_read(src, os.cpu_count() or 1)}
    results["dynamic"] = run_measured(CLI + ["quantize", str(src), str(args.out / "dynamic"), *common])
    results["static"] = run_measured(CLI + ["quantize", str(src), str(args.out / "static"), *common,
                                            "--activations", "static", "--calibration", str(data),
                                            "--calibration-length", str(args.length)])
    calibration = results["static"]["seconds"] - results["dynamic"]["seconds"]
    flops = calibration_flops(config, ids.numel(), args.length)
    target = 2 * (results["read_source"]["seconds"] + flops / (0.5 * args.peak_tflops * 1e12))
    results.update(calibration_seconds=calibration, calibration_flops=flops, target_seconds=target)
    for name in ("dynamic", "static"):
        r = results[name]
        print(f"quantize {name:>7}: {r['seconds']:8.2f} s, peak RSS {r['peak_rss'] / 1e9:6.2f} GB, "
              f"RssAnon {r['peak_rss_anon'] / 1e9:6.2f} GB")
    print(f"calibration (static - dynamic): {calibration:.2f} s over {ids.numel()} tokens; SRC per layer "
          f"{results['bytes_per_layer'] / 1e9:.2f} GB; target on the GPU (2 x (read {results['read_source']['seconds']:.2f} s"
          f" + {flops / 1e12:.1f} TFLOP at half of {args.peak_tflops:.0f} TFLOPS)): {target:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
