"""Fused-MoE problems on a GPU, shared by scripts/tune_moe.py and scripts/benchmark_moe.py.

The model shapes and quantization modes of the kernel targets, random
weights, uniform random routing, both GEMMs' inputs precomputed (the quantity
the anchors in shared/reference/kernel-anchors.md time) and a CUDA-graph timer.
"""

import argparse
import math
from dataclasses import dataclass, field

import torch
import triton.testing

from quantize_moe.kernels.activation import silu_and_mul
from quantize_moe.kernels.align import moe_align_block_size
from quantize_moe.kernels.fused_moe import gemm_output, invoke_grouped_gemm
from quantize_moe.kernels.quant import quantize_fp8
from quantize_moe.quantization.spec import UNQUANTIZED, MoEQuantSpec

COPY_BANDWIDTH = 4.3e12  # bytes/s, H200 device-to-device copy measured (kernel-anchors.md)
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
REP_MS = 20  # replay window of the benchmark's timings (and of the tuner's final choice)


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    hidden: int
    inter: int
    top_k: int


SHAPES = {
    "mixtral": Shape("Mixtral", 8, 4096, 14336, 2),
    "qwen3": Shape("Qwen3-30B-A3B", 128, 2048, 768, 8),
    "deepseek": Shape("DeepSeek-V3", 256, 7168, 2048, 8),
}


def parse_shape(text: str) -> Shape:
    """A shape named in SHAPES, or any model's as EXPERTS,HIDDEN,INTERMEDIATE,TOP_K (e.g. 64,2048,1408,6)."""
    if text in SHAPES:
        return SHAPES[text]
    try:
        experts, hidden, inter, top_k = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither one of {', '.join(SHAPES)} nor EXPERTS,HIDDEN,INTERMEDIATE,TOP_K") from None
    return Shape(f"E{experts}-H{hidden}-I{inter}-k{top_k}", experts, hidden, inter, top_k)


MODES = {
    "bf16": UNQUANTIZED,
    "fp8-tensor": MoEQuantSpec("tensor", "tensor"),
    "fp8-block128": MoEQuantSpec("block", "group", (128, 128)),
}


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


@dataclass
class GemmInputs:
    """Both GEMMs' inputs for one token count: activations quantized, SiLU·mul done, routing aligned."""

    shape: Shape
    quant: MoEQuantSpec
    weights: dict
    tokens: int
    _aligned: dict = field(default_factory=dict)

    def __post_init__(self):
        pairs = self.tokens * self.shape.top_k
        self.x = torch.randn(self.tokens, self.shape.hidden, device="cuda", dtype=torch.bfloat16)
        self.topk_weights, self.topk_ids = uniform_routing(self.tokens, self.shape)
        gate_up = torch.randn(pairs, 2 * self.shape.inter, device="cuda", dtype=torch.bfloat16)
        if self.quant.is_fp8:
            self.a = [quantize_fp8(self.x, self.quant), quantize_fp8(gate_up, self.quant, fuse_silu_mul=True)]
        else:
            self.a = [(self.x, None), (silu_and_mul(gate_up), None)]

    def aligned(self, block_m: int) -> tuple[torch.Tensor, ...]:
        if block_m not in self._aligned:
            self._aligned[block_m] = moe_align_block_size(self.topk_ids, block_m, self.shape.experts)
        return self._aligned[block_m]

    def gemm(self, index: int, config: dict):
        """A closure launching GEMM `index` (0: x @ w13^T, 1: h @ w2^T with the router weight)."""
        weight = self.weights[("w13", "w2")[index]]
        scale = self.weights.get(("w13_scale", "w2_scale")[index])
        a, a_scale = self.a[index]
        pairs = self.topk_ids.numel()
        c = gemm_output(pairs, weight.shape[1], self.x.dtype, config, "cuda")
        routed = self.topk_weights.reshape(-1) if index else None
        sorted_ids, expert_ids, num_post = self.aligned(config["BLOCK_SIZE_M"])
        a_row_divisor = 1 if index else self.shape.top_k

        def run():
            if config.get("SPLIT_K", 1) > 1:
                c.zero_()
            invoke_grouped_gemm(a, a_scale, weight, scale, c, routed, sorted_ids, expert_ids, num_post,
                                a_row_divisor, self.quant, config)

        return run

    def both(self, config1: dict, config2: dict):
        """A closure launching both GEMMs back to back, as the layer does."""
        gemm1, gemm2 = self.gemm(0, config1), self.gemm(1, config2)

        def run():
            gemm1()
            gemm2()

        return run


def time_us(fn, rep_ms: float) -> float:
    """Median µs of fn replayed in a CUDA graph, about rep_ms of replays per sample."""
    fn()  # compile and warm up outside the graph
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3
