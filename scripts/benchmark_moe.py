"""Time the Triton fused-MoE layer on a GPU against vLLM's anchors and the memory floor.

For each shape, mode and token count it times, with CUDA graphs and the
median of triton.testing.do_bench_cudagraph:
  * "gemms": both grouped-GEMM launches alone (align, activation quantization
    and SiLU·mul precomputed), the quantity the anchors in
    shared/reference/kernel-anchors.md measure;
  * "layer": the whole fused_experts call.
Routing is uniform random (each token picks top_k distinct experts), weights
random. `--sweep` times a few launch configs per row, keeps the fastest and
writes them as tuned tables (configs/ format) into --tuned-dir.

    python scripts/benchmark_moe.py --sweep --json bench.json --tuned-dir tuned/
"""

import argparse
import json
import math
from dataclasses import dataclass

import torch
import triton
import triton.testing

from quantize_moe.kernels import fused_experts
from quantize_moe.kernels.align import moe_align_block_size
from quantize_moe.kernels.activation import silu_and_mul
from quantize_moe.kernels.configs import config_file_name, get_config
from quantize_moe.kernels.fused_moe import invoke_grouped_gemm
from quantize_moe.kernels.quant import quantize_fp8
from quantize_moe.moe.quant_spec import UNQUANTIZED, MoEQuantSpec

COPY_BANDWIDTH = 4.3e12  # bytes/s, H200 device-to-device copy measured (kernel-anchors.md)


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    hidden: int
    inter: int
    top_k: int
    tokens: tuple[int, ...]


SHAPES = {
    "mixtral": Shape("Mixtral", 8, 4096, 14336, 2, (1, 16, 64, 256, 1024, 4096)),
    "qwen3": Shape("Qwen3-30B-A3B", 128, 2048, 768, 8, (1, 64, 1024, 4096)),
    "deepseek": Shape("DeepSeek-V3", 256, 7168, 2048, 8, (1, 64, 1024, 4096)),
}
MODES = {
    "bf16": UNQUANTIZED,
    "fp8-tensor": MoEQuantSpec("tensor", "tensor"),
    "fp8-block128": MoEQuantSpec("block", "group", (128, 128)),
}
# vLLM's Triton fused MoE on an H200, both GEMMs, µs (kernel-anchors.md).
ANCHORS = {
    ("Mixtral", 1): (177, 102, 206), ("Mixtral", 16): (642, 347, 1056), ("Mixtral", 64): (659, 350, 1075),
    ("Mixtral", 256): (738, 404, 1418), ("Mixtral", 1024): (1565, 859, 4035), ("Mixtral", 4096): (5029, 2685, 14722),
    ("Qwen3-30B-A3B", 1): (25, 19, 21), ("Qwen3-30B-A3B", 64): (288, 252, 428),
    ("Qwen3-30B-A3B", 1024): (364, 390, 656), ("Qwen3-30B-A3B", 4096): (765, 1174, 1829),
    ("DeepSeek-V3", 1): (193, 126, 149), ("DeepSeek-V3", 64): (6899, 4099, 6212),
    ("DeepSeek-V3", 1024): (9350, 5112, 7426), ("DeepSeek-V3", 4096): (15655, 12354, 17619),
}
# (BLOCK_M, BLOCK_N, BLOCK_K for fp8, BLOCK_K for bf16, GROUP_M, warps, stages)
SWEEP = [
    (16, 64, 128, 128, 1, 4, 4), (16, 128, 128, 64, 1, 4, 4), (32, 64, 128, 64, 1, 4, 4),
    (64, 64, 128, 64, 1, 4, 4), (64, 128, 128, 64, 1, 4, 3), (128, 128, 128, 64, 8, 8, 3),
    (128, 256, 128, 64, 8, 8, 3),
]


def memory_floor_us(shape: Shape, tokens: int, weight_bytes: int) -> float:
    active = shape.experts * (1 - (1 - shape.top_k / shape.experts) ** tokens)
    return active * 3 * shape.hidden * shape.inter * weight_bytes / COPY_BANDWIDTH * 1e6


def random_weights(shape: Shape, quant: MoEQuantSpec) -> dict:
    """Random expert weights; FP8 ones with random positive scales (values do not affect timing)."""
    e, h, i = shape.experts, shape.hidden, shape.inter
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * i ** -0.5
    if not quant.is_fp8:
        return dict(w13=w13, w2=w2)

    def fp8(w):
        scale_shape = {"tensor": (e,), "block": (e, math.ceil(w.shape[1] / 128), math.ceil(w.shape[2] / 128))}
        return (w * 64).to(torch.float8_e4m3fn), torch.rand(scale_shape[quant.weight], device="cuda") / 64 + 1e-4

    (w13, w13_scale), (w2, w2_scale) = fp8(w13), fp8(w2)
    return dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)


def uniform_routing(tokens: int, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(tokens, shape.experts, device="cuda").argsort(dim=1)[:, : shape.top_k].to(torch.int32)
    return torch.softmax(torch.randn(tokens, shape.top_k, device="cuda"), dim=-1), ids


def gemms_only(x, weights, topk_weights, topk_ids, quant, config):
    """A closure running the two GEMM launches on precomputed inputs."""
    top_k = topk_ids.shape[1]
    num_pairs = topk_ids.numel()
    routing = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], weights["w13"].shape[0])
    gemm = dict(zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), routing), quant=quant, config=config)
    a1, a1_scale = quantize_fp8(x, quant) if quant.is_fp8 else (x, None)
    gate_up = torch.randn(num_pairs, weights["w13"].shape[1], device="cuda", dtype=x.dtype)
    a2, a2_scale = quantize_fp8(gate_up, quant, fuse_silu_mul=True) if quant.is_fp8 else (silu_and_mul(gate_up), None)
    out = torch.empty(num_pairs, weights["w2"].shape[1], device="cuda", dtype=x.dtype)
    flat_weights = topk_weights.reshape(-1)

    def run():
        invoke_grouped_gemm(a1, a1_scale, weights["w13"], weights.get("w13_scale"), gate_up, None, a_row_divisor=top_k, **gemm)
        invoke_grouped_gemm(a2, a2_scale, weights["w2"], weights.get("w2_scale"), out, flat_weights, a_row_divisor=1, **gemm)

    return run


def time_us(fn) -> float:
    fn()  # compile and warm up outside the graph
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def candidate_configs(quant: MoEQuantSpec) -> list[dict]:
    keys = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
    return [dict(zip(keys, (m, n, k8 if quant.is_fp8 else k16, g, w, s))) for m, n, k8, k16, g, w, s in SWEEP]


def bench_row(shape, mode, tokens, weights, sweep):
    quant = MODES[mode]
    x = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = uniform_routing(tokens, shape)
    configs = candidate_configs(quant) if sweep else [get_config(tokens, shape.experts, 2 * shape.inter, shape.top_k, quant)]
    timed = [(time_us(gemms_only(x, weights, topk_weights, topk_ids, quant, c)), c) for c in configs]
    gemm_us, config = min(timed, key=lambda t: t[0])
    kwargs = {k: v for k, v in weights.items() if k.endswith("scale")}
    layer_us = time_us(lambda: fused_experts(x, weights["w13"], weights["w2"], topk_weights, topk_ids,
                                             quant=quant, config=config, **kwargs))
    anchor = ANCHORS.get((shape.name, tokens))
    return dict(
        shape=shape.name, mode=mode, tokens=tokens, gemms_us=gemm_us, layer_us=layer_us,
        anchor_us=anchor[list(MODES).index(mode)] if anchor else None,
        floor_us=memory_floor_us(shape, tokens, 1 if quant.is_fp8 else 2), config=config,
    )


def print_table(rows):
    print(f"{'shape':15} {'mode':13} {'T':>5} {'gemms µs':>9} {'layer µs':>9} {'vLLM µs':>8} {'floor µs':>9} {'floor/gemms':>11}")
    for r in rows:
        anchor = f"{r['anchor_us']:.0f}" if r["anchor_us"] else "-"
        print(f"{r['shape']:15} {r['mode']:13} {r['tokens']:>5} {r['gemms_us']:>9.1f} {r['layer_us']:>9.1f} "
              f"{anchor:>8} {r['floor_us']:>9.1f} {r['floor_us'] / r['gemms_us']:>10.0%}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--sweep", action="store_true", help="try the SWEEP launch configs, keep the fastest")
    parser.add_argument("--json", help="write all rows (with the chosen configs) to this file")
    parser.add_argument("--tuned-dir", help="with --sweep: write the fastest configs as tuned tables here")
    args = parser.parse_args()

    torch.manual_seed(0)
    rows = []
    for shape in (SHAPES[s] for s in args.shapes):
        for mode in args.modes:
            weights = random_weights(shape, MODES[mode])
            shape_rows = [bench_row(shape, mode, tokens, weights, args.sweep) for tokens in shape.tokens]
            print_table(shape_rows)
            rows += shape_rows
            del weights
            torch.cuda.empty_cache()
            if args.sweep and args.tuned_dir:
                name = config_file_name(shape.experts, 2 * shape.inter, torch.cuda.get_device_name(), MODES[mode])
                with open(f"{args.tuned_dir}/{name}", "w") as f:
                    json.dump({str(r["tokens"]): r["config"] for r in shape_rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
