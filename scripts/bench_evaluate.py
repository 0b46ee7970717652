"""Peak memory of the layer-streamed runs, `evaluate`, `validate --data` and calibration (`quantize
--activations static --calibration`), on synthetic Mixtral-shaped checkpoints of several layer counts: they
must stay flat as layers are added, at 1.5 layers plus the activations (issue 17).

For each layer count, writes a bf16 checkpoint (`make_synthetic_mixtral`), quantizes it, and runs
`evaluate SRC DST --data ids.safetensors`, `validate SRC DST --data ...`, the calibration alone (the model
run with its hooks, `run.calibration.calibrate`) and `quantize SRC --activations static --calibration ...`
(calibration, then the quantize pipeline, whose own peak the dynamic `quantize` shows) as separate
processes, polling peak RSS and RssAnon (`process_memory`); also measures the RssAnon of the imports alone,
so that (peak - imports) can be read against one layer's bf16 bytes, beside the bf16 hidden states of the
tokens (the activations the streamed runs keep from layer to layer).

    python scripts/bench_evaluate.py --layers 2,8 --hidden 512 --expert-width 2048 --experts 8   # CPU
    python scripts/bench_evaluate.py --layers 2,8 --device cuda --samples 8 --length 2048        # H200
    python scripts/bench_evaluate.py --layers 2,8 --hidden 2048 --expert-width 7168 --vocab 8000 \
        --samples 4 --commands calibrate,"quantize --activations static"                       # calibration
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
           "quantize_moe.check.validate, quantize_moe.run.calibration, quantize_moe.write.job, quantize_moe.cli.app"]
# The calibration alone: the model run over the tokens with its hooks, as `quantize` runs it before quantizing.
CALIBRATE = [sys.executable, "-c", "import sys; from pathlib import Path; from quantize_moe.adapters.reader import "
             "SourceReader; from quantize_moe.source.checkpoint import Checkpoint; from quantize_moe.run.calibration "
             "import calibrate; from quantize_moe.run.tokens import load_tokens; src = Path(sys.argv[1]); "
             "calibrate(SourceReader(Checkpoint(src)), load_tokens(Path(sys.argv[2]), src, int(sys.argv[3]), None), "
             "sys.argv[4])"]
COMMANDS = ("quantize", "evaluate", "validate --data", "calibrate", "quantize --activations static")


def layer_bytes() -> int:
    """bf16 bytes of one decoder layer of the synthetic checkpoint."""
    return 2 * sum(torch.Size(shape).numel() for name, shape in synthetic.tensor_shapes(1, 1)
                   if name.startswith("model.layers.0."))


def static_dst(dst: Path) -> Path:
    return dst.with_name(dst.name + "-static")


def commands(src: Path, dst: Path, ids: Path, args) -> dict[str, list[str]]:
    """Each measured command's argv; `quantize` writes the DST that `evaluate` and `validate` compare."""
    def quantize(out: Path, *options: str) -> list[str]:
        return CLI + ["quantize", str(src), str(out), "--overwrite", "--no-progress", "--device", args.device, *options]

    return {
        "quantize": quantize(dst),
        "evaluate": CLI + ["evaluate", str(src), str(dst), "--data", str(ids), "--device", args.device,
                           "--max-perplexity-ratio", "100", "--max-kl", "100", "--min-top1", "0",
                           "--json", str(dst.with_name(dst.name + "-eval.json"))],
        "validate --data": CLI + ["validate", str(src), str(dst), "--data", str(ids), "--device", args.device,
                                  "--no-progress", "--max-relative-error", "100", "--min-cosine", "-1",
                                  "--max-kernel-error", "100"],
        "calibrate": CALIBRATE + [str(src), str(ids), str(args.length), args.device],
        "quantize --activations static": quantize(static_dst(dst), "--activations", "static", "--calibration", str(ids),
                                                  "--calibration-length", str(args.length)),
    }


def measure(root: Path, layers: int, args) -> dict:
    src, dst = root / f"n{layers}-bf16", root / f"n{layers}-fp8"
    synthetic.write_checkpoint(src, layers, vocab=args.vocab, shard_bytes=int(args.shard_gb * 1e9))
    argv, steps = commands(src, dst, root / "ids.safetensors", args), {}
    for name in args.commands:
        steps[name] = run_measured(argv[name])
        print(f"{layers} layers, {name:>29}: {steps[name]['cpu_seconds']:7.1f} CPU s, peak RSS "
              f"{steps[name]['peak_rss'] / 1e6:8.1f} MB, RssAnon {steps[name]['peak_rss_anon'] / 1e6:8.1f} MB",
              flush=True)
    if not args.keep:
        for folder in (src, dst, static_dst(dst)):
            shutil.rmtree(folder, ignore_errors=True)
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
    parser.add_argument("--commands", default="quantize,evaluate,validate --data",
                        help=f"comma-separated, of: {', '.join(COMMANDS)} (evaluate and validate need quantize)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    args.commands = [name for name in COMMANDS if name in args.commands.split(",")]  # quantize first
    synthetic.set_shape(args.hidden, args.expert_width, args.experts)
    args.out.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(0, args.vocab, (args.samples, args.length), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, args.out / "ids.safetensors")
    imports = run_measured(IMPORTS)["peak_rss_anon"]
    one_layer, hidden_states = layer_bytes(), 2 * ids.numel() * args.hidden
    results = {"shape": [args.hidden, args.expert_width, args.experts], "tokens": ids.numel(),
               "device": args.device, "layer_bf16_bytes": one_layer, "hidden_states_bytes": hidden_states,
               "imports_rss_anon": imports, "layers": {}}
    print(f"one layer: {one_layer / 1e6:.1f} MB bf16; the tokens' hidden states: {hidden_states / 1e6:.1f} MB "
          f"({hidden_states / one_layer:.3f} layer); imports alone: RssAnon {imports / 1e6:.1f} MB")
    for layers in map(int, args.layers.split(",")):
        results["layers"][layers] = measure(args.out, layers, args)
    for name in args.commands:
        above = [(n, (r[name]["peak_rss_anon"] - imports) / one_layer) for n, r in results["layers"].items()]
        print(f"{name}: RssAnon above the imports, in layers: " + ", ".join(f"{n} layers {x:.2f}" for n, x in above))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
