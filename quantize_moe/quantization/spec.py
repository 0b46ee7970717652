"""How the weights and activations of one fused-MoE layer are quantized.

Shared by the torch reference, the Triton kernels and the quantization-method
objects, so that all three agree on scale shapes:

| weight | w13 scale            | w2 scale            | activations                      |
|--------|----------------------|---------------------|----------------------------------|
| none   | -                    | -                   | bf16/fp16                        |
| tensor | [E] float32          | [E] float32         | dynamic per token or per tensor, |
|        |                      |                     | or static: w13/w2 input scales   |
| channel| [E, 2I] float32      | [E, H] float32      | dynamic per token                |
| block  | [E, ceil(2I/bn), ceil(H/bk)] | [E, ceil(H/bn), ceil(I/bk)] | dynamic per token and bk channels |

Static activations (calibrated, per tensor) come with per-expert input scales
`w13_input_scale` / `w2_input_scale` [E] in the checkpoint, which the layer reduces to
their max over experts at load, as vLLM's Fp8MoEMethod does: one float32 scale per GEMM.

A scale is always the dequantization multiplier: w ~= w_fp8.float() * scale.
"""

from dataclasses import dataclass
from typing import Literal

import torch

WeightScheme = Literal["none", "tensor", "channel", "block"]
ActivationScheme = Literal["token", "tensor", "group", "static"]


@dataclass(frozen=True)
class MoEQuantSpec:
    weight: WeightScheme = "none"
    activation: ActivationScheme = "token"
    block_shape: tuple[int, int] | None = None  # (bn, bk) for weight == "block"

    def __post_init__(self) -> None:
        if (self.weight == "block") != (self.block_shape is not None):
            raise ValueError("block_shape is given exactly when weight == 'block'")
        if self.weight == "block" and self.activation != "group":
            raise ValueError("block weights go with per-token-group activations")
        if self.weight == "channel" and self.activation != "token":
            raise ValueError("channel weights go with per-token activations")
        if self.activation == "static" and self.weight != "tensor":
            raise ValueError("static activations go with per-tensor weights")

    @property
    def is_fp8(self) -> bool:
        return self.weight != "none"

    @property
    def static(self) -> bool:
        """Activations quantized with calibrated input scales from the checkpoint."""
        return self.activation == "static"


UNQUANTIZED = MoEQuantSpec()


def scale_count(spec: MoEQuantSpec, shape: tuple[int, ...]) -> int:
    """How many scale values one [N, K] weight has under `spec`: 1, N, or one per block."""
    rows, cols = (1, *shape)[-2:]
    if spec.weight == "tensor":
        return 1
    if spec.weight == "channel":
        return rows
    block_n, block_k = spec.block_shape
    return -(-rows // block_n) * -(-cols // block_k)


def weight_cell(spec: MoEQuantSpec, shape: tuple[int, int]) -> tuple[int, int]:
    """The part of one [N, K] weight that one scale covers under `spec`: all of it, a row, or a block."""
    if spec.weight == "tensor":
        return tuple(shape)
    if spec.weight == "channel":
        return 1, shape[1]
    return spec.block_shape


def expand_weight_scale(scale: torch.Tensor, spec: MoEQuantSpec, shape: torch.Size) -> torch.Tensor:
    """A weight scale of any scheme, shaped to broadcast against stacked weights [E, N, K]:
    per-tensor [E] -> [E, 1, 1]; per-channel [E, N] (or [E, N, 1]) -> [E, N, 1]; block scales are
    repeated over the rows and columns of their blocks and cut to [E, N, K]."""
    num_experts, rows, cols = shape
    if spec.weight == "tensor":
        return scale.reshape(num_experts, 1, 1)
    if spec.weight == "channel":
        return scale.reshape(num_experts, rows, 1)
    block_n, block_k = spec.block_shape
    return scale.repeat_interleave(block_n, dim=1)[:, :rows].repeat_interleave(block_k, dim=2)[:, :, :cols]
