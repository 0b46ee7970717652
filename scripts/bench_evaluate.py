"""Peak memory and wall time of `evaluate` (and `validate --data`) on synthetic Mixtral-shaped checkpoints of
several layer counts: the layer-streamed forward must stay flat as layers are added (issue 17).

For each layer count, writes a bf16 checkpoint (`make_synthetic_mixtral`), quantizes it, and runs
`evaluate SRC DST --data ids.safetensors` and `validate SRC DST --data ...` as separate processes, polling
peak RSS and RssAnon (`process_memory`); also measures the RssAnon of the imports alone, so that
(peak - imports) can be read against one layer's bf16 bytes.

    python scripts/bench_evaluate.py --layers 2,8 --hidden 512 --expert-width 2048 --experts 8   # CPU
    python scripts/bench_evaluate.py --layers 2,8 --device cuda --samples 8 --length 2048        # H200
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import make_synthetic_mixtral as synthetic
from process_memory import run_measured

CLI = [sys.executable, "-m", "quantize_moe"]
IMPORTS = [sys.executable, "-c", "import torch, transformers; import quantize_moe.check.streamed_eval, "
           "quantize_moe.check.validate"]


def layer_bytes() -> int:
    """bf16 bytes of one decoder layer of the synthetic checkpoint."""
    return 2 * sum(torch.Size(shape).numel() for name, shape in synthetic.tensor_shapes(1, 1)
                   if name.startswith("model.layers.0."))


def measure(root: Path, layers: int, args) -> dict:
    src, dst, ids = root / f"n{layers}-bf16", root / f"n{layers}-fp8", root / "ids.safetensors"
    synthetic.write_checkpoint(src, layers, vocab=args.vocab, shard_bytes=int(args.shard_gb * 1e9))
    run_measured(CLI + ["quantize", str(src), str(dst), "--overwrite", "--no-progress", "--device", args.device])
    steps = {}
    for name, command in (("evaluate", ["evaluate", str(src), str(dst), "--data", str(ids), "--device",
                                        args.device, "--max-perplexity-ratio", "100", "--max-kl", "100",
                                        "--min-top1", "0", "--json", str(root / f"n{layers}-eval.json")]),
                          ("validate --data", ["validate", str(src), str(dst), "--data", str(ids), "--device",
                                               args.device, "--no-progress", "--max-relative-error", "100",
                                               "--min-cosine", "-1", "--max-kernel-error", "100"])):
        steps[name] = run_measured(CLI + command)
        print(f"{layers} layers, {name:>15}: {steps[name]['seconds']:7.2f} s, peak RSS "
              f"{steps[name]['peak_rss'] / 1e6:8.1f} MB, RssAnon {steps[name]['peak_rss_anon'] / 1e6:8.1f} MB",
              flush=True)
    if not args.keep:
        shutil.rmtree(src), shutil.rmtree(dst)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="2,8", help="comma-separated layer counts")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-evaluate"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=synthetic.HIDDEN)
    parser.add_argument("--expert-width", type=int, default=synthetic.EXPERT_WIDTH)
    parser.add_argument("--experts", type=int, default=synthetic.EXPERTS)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--shard-gb", type=float, default=2.0)
    parser.add_argument("--samples", type=int, default=2, help="sequences of --length tokens")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    synthetic.set_shape(args.hidden, args.expert_width, args.experts)
    args.out.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(0, args.vocab, (args.samples, args.length), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, args.out / "ids.safetensors")
    imports = run_measured(IMPORTS)["peak_rss_anon"]
    one_layer = layer_bytes()
    results = {"shape": [args.hidden, args.expert_width, args.experts], "tokens": ids.numel(),
               "device": args.device, "layer_bf16_bytes": one_layer, "imports_rss_anon": imports, "layers": {}}
    print(f"one layer: {one_layer / 1e6:.1f} MB bf16; imports alone: RssAnon {imports / 1e6:.1f} MB")
    for layers in map(int, args.layers.split(",")):
        results["layers"][layers] = measure(args.out, layers, args)
    for name in ("evaluate", "validate --data"):
        above = [(n, (r[name]["peak_rss_anon"] - imports) / one_layer) for n, r in results["layers"].items()]
        print(f"{name}: RssAnon above the imports, in layers: " + ", ".join(f"{n} layers {x:.2f}" for n, x in above))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
