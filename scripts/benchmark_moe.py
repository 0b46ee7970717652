"""Time the Triton fused-MoE layer on a GPU against vLLM's anchors and the memory floor.

For each shape, mode and token count, with the launch configs the layer picks
itself (tuned tables in configs/, else the heuristic), it times with CUDA
graphs (median of triton.testing.do_bench_cudagraph):
  * "gemms": both grouped-GEMM launches alone (align, activation quantization
    and SiLU·mul precomputed), the quantity the anchors in
    shared/reference/kernel-anchors.md measure;
  * "layer": the whole fused_experts call.
Routing is uniform random (each token picks top_k distinct experts), weights
random. Tables come from scripts/tune_moe.py.

    python scripts/benchmark_moe.py --json bench.json --passes 3
"""

import argparse
import json
import statistics

import torch
import triton

from moe_problems import MODES, REP_MS, SHAPES, TOKENS, GemmInputs, memory_floor_us, random_weights, time_us
from quantize_moe.kernels import fused_experts
from quantize_moe.kernels.configs import get_config

# vLLM's Triton fused MoE on an H200, both GEMMs, µs (kernel-anchors.md): bf16, fp8 per-tensor, fp8 block.
ANCHORS = {
    ("Mixtral", 1): (177, 102, 206), ("Mixtral", 16): (642, 347, 1056), ("Mixtral", 64): (659, 350, 1075),
    ("Mixtral", 256): (738, 404, 1418), ("Mixtral", 1024): (1565, 859, 4035), ("Mixtral", 4096): (5029, 2685, 14722),
    ("Qwen3-30B-A3B", 1): (25, 19, 21), ("Qwen3-30B-A3B", 64): (288, 252, 428),
    ("Qwen3-30B-A3B", 1024): (364, 390, 656), ("Qwen3-30B-A3B", 4096): (765, 1174, 1829),
    ("DeepSeek-V3", 1): (193, 126, 149), ("DeepSeek-V3", 64): (6899, 4099, 6212),
    ("DeepSeek-V3", 1024): (9350, 5112, 7426), ("DeepSeek-V3", 4096): (15655, 12354, 17619),
}


def bench_row(shape, mode, tokens, weights):
    quant = MODES[mode]
    inputs = GemmInputs(shape, quant, weights, tokens)
    config1, config2 = get_config(tokens, shape.experts, 2 * shape.inter, shape.top_k, quant)
    kwargs = {k: v for k, v in weights.items() if k.endswith("scale")}
    layer_us = time_us(lambda: fused_experts(inputs.x, weights["w13"], weights["w2"], inputs.topk_weights,
                                             inputs.topk_ids, quant=quant, **kwargs), REP_MS)
    anchor = ANCHORS.get((shape.name, tokens))
    return dict(
        shape=shape.name, mode=mode, tokens=tokens, gemms_us=time_us(inputs.both(config1, config2), REP_MS), layer_us=layer_us,
        anchor_us=anchor[list(MODES).index(mode)] if anchor else None,
        floor_us=memory_floor_us(shape, tokens, 1 if quant.is_fp8 else 2), gemm1=config1, gemm2=config2,
    )


def median_rows(passes: list[list[dict]]) -> list[dict]:
    """Each row with the median of its passes' times, and the spread of its GEMM times (max - min) / median."""
    rows = []
    for same_row in zip(*passes):
        gemms = sorted(r["gemms_us"] for r in same_row)
        row = dict(same_row[0], gemms_us=statistics.median(gemms),
                   layer_us=statistics.median(r["layer_us"] for r in same_row), passes=len(same_row))
        rows.append(dict(row, spread=(gemms[-1] - gemms[0]) / row["gemms_us"]))
    return rows


def print_table(rows):
    print(f"{'shape':15} {'mode':13} {'T':>5} {'gemms µs':>9} {'spread':>7} {'layer µs':>9} {'vLLM µs':>8} "
          f"{'floor µs':>9} {'floor/gemms':>11}")
    for r in rows:
        anchor = f"{r['anchor_us']:.0f}" if r["anchor_us"] else "-"
        print(f"{r['shape']:15} {r['mode']:13} {r['tokens']:>5} {r['gemms_us']:>9.1f} {r.get('spread', 0):>7.1%} "
              f"{r['layer_us']:>9.1f} {anchor:>8} {r['floor_us']:>9.1f} {r['floor_us'] / r['gemms_us']:>10.0%}",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--json", help="write all rows (with the configs used) to this file")
    parser.add_argument("--passes", type=int, default=1,
                        help="sweep this many times and report each row's median (large-T rows vary by several "
                             "percent with the card's clocks)")
    args = parser.parse_args()

    torch.manual_seed(0)
    passes = []
    for _ in range(args.passes):
        passes.append([])
        for shape in (SHAPES[s] for s in args.shapes):
            for mode in args.modes:
                weights = random_weights(shape, MODES[mode])
                shape_rows = [bench_row(shape, mode, tokens, weights) for tokens in args.tokens]
                print_table(shape_rows)
                passes[-1] += shape_rows
                del weights
                torch.cuda.empty_cache()
    rows = median_rows(passes)
    print(f"\n{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}, "
          f"median of {args.passes} pass(es)")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
