"""Random fused-MoE problems shared by the CPU, interpreter and GPU kernel tests."""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from quantize_moe.quantization.spec import UNQUANTIZED, MoEQuantSpec
from quantize_moe.moe.reference import FP8_MAX_INV, dequantize_weight, fake_quantize, quantize_weight

# Every quantization mode the kernels support, by a short test id.
MODES = {
    "fp8-tensor-token": MoEQuantSpec("tensor", "token"),
    "fp8-tensor-tensor": MoEQuantSpec("tensor", "tensor"),
    "fp8-channel": MoEQuantSpec("channel", "token"),
    "fp8-block128": MoEQuantSpec("block", "group", (128, 128)),
}
# Static per-tensor activations need scales per problem (`with_static_scales`), so they are a mode of their own.
STATIC = MoEQuantSpec("tensor", "static")


@dataclass
class Problem:
    hidden_states: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    quant: MoEQuantSpec = UNQUANTIZED
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None

    def args(self):
        return self.hidden_states, self.w13, self.w2, self.topk_weights, self.topk_ids

    def kwargs(self):
        return dict(quant=self.quant, w13_scale=self.w13_scale, w2_scale=self.w2_scale, a13_scale=self.a13_scale,
                    a2_scale=self.a2_scale)


def random_problem(tokens, hidden, inter, experts, top_k, dtype=torch.float32, device="cpu") -> Problem:
    """Unit-variance activations; weights scaled by 1/sqrt(fan-in) so outputs stay O(1)."""
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    topk_ids = torch.rand(tokens, experts, device=device).argsort(dim=1)[:, :top_k].to(torch.int32)
    return Problem(
        hidden_states=randn(tokens, hidden),
        w13=randn(experts, 2 * inter, hidden, scale=hidden ** -0.5),
        w2=randn(experts, hidden, inter, scale=inter ** -0.5),
        topk_weights=torch.softmax(torch.randn(tokens, top_k, device=device), dim=-1),
        topk_ids=topk_ids,
    )


def quantized(problem: Problem, quant: MoEQuantSpec) -> Problem:
    """The same problem with FP8 weights."""
    w13, w13_scale = quantize_weight(problem.w13, quant)
    w2, w2_scale = quantize_weight(problem.w2, quant)
    return replace(problem, w13=w13, w2=w2, quant=quant, w13_scale=w13_scale, w2_scale=w2_scale)


def with_static_scales(problem: Problem, headroom: float = 1.0) -> Problem:
    """The problem with FP8 per-tensor weights and static activation scales: amax / 448 of each GEMM's
    input as a calibration on these very tokens measures it, times `headroom` (< 1 saturates the largest
    inputs, as scales calibrated on other text do). With headroom 1 these are the dynamic per-tensor scales."""
    p = quantized(problem, STATIC)
    a13_scale = (p.hidden_states.float().abs().max() * FP8_MAX_INV * headroom).reshape(1)
    x = fake_quantize(p.hidden_states.float(), STATIC, a13_scale)  # what the second GEMM's input comes from
    w13 = dequantize_weight(p.w13, p.w13_scale, STATIC, torch.float32)
    inter, act_amax = p.w2.shape[2], torch.zeros((), device=x.device)
    for expert in p.topk_ids.unique().tolist():
        rows = (p.topk_ids == expert).any(dim=1)
        gate_up = x[rows] @ w13[expert].T
        act_amax = torch.maximum(act_amax, (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).abs().max())
    return replace(p, a13_scale=a13_scale, a2_scale=(act_amax * FP8_MAX_INV * headroom).reshape(1))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def assert_valid_alignment(topk_ids, block_m, num_experts, sorted_ids, expert_ids, num_post) -> None:
    """The contract of moe_align_block_size: every pair once, one expert per block, sentinel padding."""
    sorted_ids, expert_ids, flat = sorted_ids.cpu(), expert_ids.cpu(), topk_ids.reshape(-1).cpu()
    num_pairs, used = flat.numel(), int(num_post)
    counts = torch.bincount(flat.long(), minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.numel() % block_m == 0 and expert_ids.numel() == sorted_ids.numel() // block_m
    real = sorted_ids[:used][sorted_ids[:used] < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    assert (sorted_ids[used:] == num_pairs).all()
    for block in range(used // block_m):
        rows = sorted_ids[block * block_m:(block + 1) * block_m]
        rows = rows[rows < num_pairs]
        assert len(rows) > 0 and (flat[rows.long()] == expert_ids[block]).all()
    assert (expert_ids[used // block_m:] == -1).all()
