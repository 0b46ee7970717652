"""Random fused-MoE problems shared by the CPU, interpreter and GPU kernel tests."""

from dataclasses import dataclass, replace

import torch

from quantize_moe.moe.quant_spec import UNQUANTIZED, MoEQuantSpec
from quantize_moe.moe.reference import quantize_weight

# Every quantization mode the kernels support, by a short test id.
MODES = {
    "fp8-tensor-token": MoEQuantSpec("tensor", "token"),
    "fp8-tensor-tensor": MoEQuantSpec("tensor", "tensor"),
    "fp8-channel": MoEQuantSpec("channel", "token"),
    "fp8-block128": MoEQuantSpec("block", "group", (128, 128)),
}


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

    def args(self):
        return self.hidden_states, self.w13, self.w2, self.topk_weights, self.topk_ids

    def kwargs(self):
        return dict(quant=self.quant, w13_scale=self.w13_scale, w2_scale=self.w2_scale)


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


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()
