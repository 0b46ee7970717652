"""Pure-torch reference of the fused-MoE layer, on CPU or GPU.

It computes what `quantize_moe.kernels.fused_experts` computes, one expert at
a time and in a caller-chosen precision (float64 for the "float64
reference"), so that the kernels can be checked against it. When the weights
are FP8, activations are quantized exactly as the kernels do it (same scale
formula, same rounding), so kernel and reference differ only by the kernel's
accumulation and intermediate rounding. `quantize_activations=False` keeps
activations unquantized, which separates kernel error from activation
quantization error.
"""

import torch
import torch.nn.functional as F

from quantize_moe.quantization import fp8
from quantize_moe.quantization.spec import UNQUANTIZED, MoEQuantSpec, expand_weight_scale

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Scales are amax * (1 / 448) rather than amax / 448: a multiplication rounds
# the same way in torch and in Triton, a division need not.
FP8_MAX_INV = 1.0 / FP8_MAX
# Keeps the scale of an all-zero row or group positive (no division by zero).
MIN_SCALE = 1e-12


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() * FP8_MAX_INV).clamp(min=MIN_SCALE)


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # torch turns out-of-range values into NaN; the GPU conversion saturates.
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization with one scale per row: returns (q [T, K], scale [T, 1])."""
    scale = _scale_from_amax(x.abs().amax(dim=-1, keepdim=True))
    return _to_fp8(x, scale), scale


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization with one scale for the whole tensor: returns (q, scale [1])."""
    scale = _scale_from_amax(x.abs().amax()).reshape(1)
    return _to_fp8(x, scale), scale


def quantize_per_token_group(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization with one scale per row and `group_size` columns.

    Returns (q [T, K], scale [T, ceil(K / group_size)]); the last group may be short.
    """
    rows, cols = x.shape
    num_groups = -(-cols // group_size)
    padded = F.pad(x.float().abs(), (0, num_groups * group_size - cols))
    scale = _scale_from_amax(padded.view(rows, num_groups, group_size).amax(dim=-1))
    return _to_fp8(x, _expand_groups(scale, group_size, cols)), scale


def _expand_groups(scale: torch.Tensor, group_size: int, length: int) -> torch.Tensor:
    """Repeat each scale over the `group_size` positions it covers along the last dim."""
    return scale.repeat_interleave(group_size, dim=-1)[..., :length]


def quantize_activation(x: torch.Tensor, quant: MoEQuantSpec,
                        static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations [T, K] as `quant.activation` says: (q, scale). Static activations take their
    calibrated scale [1] from the checkpoint; values past 448 x scale saturate, as in the engines."""
    if quant.static:
        if static_scale is None:
            raise ValueError("static activations need their input scale")
        scale = static_scale.float().reshape(1).to(x.device)
        return _to_fp8(x, scale), scale
    if quant.activation == "token":
        return quantize_per_token(x)
    if quant.activation == "tensor":
        return quantize_per_tensor(x)
    return quantize_per_token_group(x, quant.block_shape[1])


def dequantize_activation(
    q: torch.Tensor, scale: torch.Tensor, quant: MoEQuantSpec, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of `quantize_activation`."""
    if quant.activation == "group":
        scale = _expand_groups(scale, quant.block_shape[1], q.shape[-1])
    return q.to(dtype) * scale.to(dtype)


def dequantize_weight(
    w: torch.Tensor, scale: torch.Tensor | None, quant: MoEQuantSpec, dtype: torch.dtype
) -> torch.Tensor:
    """Stacked expert weights [E, N, K] in `dtype`, scaled per `quant.weight`."""
    if not quant.is_fp8:
        return w.to(dtype)
    return w.to(dtype) * expand_weight_scale(scale.to(dtype), quant, w.shape)


def quantize_weight(w: torch.Tensor, quant: MoEQuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 expert weights [E, N, K] and their scales (shapes as in quant_spec.py), on w's device.

    For tests and test fixtures: each expert goes through the quantizer that
    writes checkpoints (`quantize_moe.quantization.fp8`, on the CPU), so kernels are checked on the
    weights the tool ships.
    """
    num_experts, rows, cols = w.shape
    cell = {"tensor": (rows, cols), "channel": (1, cols), "block": quant.block_shape}[quant.weight]
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    grid = torch.stack([fp8.quantize_cells(expert, cell, out, f"expert {e}")
                        for e, (expert, out) in enumerate(zip(w.cpu(), q))])  # [E, grid rows, grid cols]
    if quant.weight != "block":  # [E] per tensor, [E, N] per channel
        grid = grid.reshape(num_experts, rows) if quant.weight == "channel" else grid.reshape(num_experts)
    return q.to(w.device), grid.to(w.device)


def fake_quantize(x: torch.Tensor, quant: MoEQuantSpec, static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Round activations [T, K] through FP8 and back, keeping x's dtype."""
    q, scale = quantize_activation(x.float(), quant, static_scale)
    return dequantize_activation(q, scale, quant, x.dtype)


def fused_experts_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    quant: MoEQuantSpec = UNQUANTIZED,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    a13_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    quantize_activations: bool = True,
    weights_dequantized: bool = False,
) -> torch.Tensor:
    """The MoE layer sum_k w_k * W2_e (SiLU(gate_e x) * up_e x), returned in compute_dtype.

    hidden_states [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I];
    topk_weights [T, k]; topk_ids [T, k]. FP8 weights are dequantized with their
    scales; when quant.is_fp8 and quantize_activations, the GEMM inputs are
    quantized as the kernels do: dynamically (the second GEMM's input over all
    (token, k) pairs at once, which matters for per-tensor scales), or with the
    static scales a13_scale / a2_scale [1]. With weights_dequantized, w13 and
    w2 are FP8 weights already dequantized (the layer-streamed model's): only
    the activations are quantized as `quant` says.
    """
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[2]
    fake_quant = quant.is_fp8 and quantize_activations

    def expert_weight(w: torch.Tensor, scale: torch.Tensor | None, expert: int) -> torch.Tensor:
        """One expert in compute_dtype: a float64 copy of a whole layer would dwarf the layer itself."""
        if weights_dequantized:
            return w[expert].to(compute_dtype)
        return dequantize_weight(w[expert:expert + 1], None if scale is None else scale[expert:expert + 1],
                                 quant, compute_dtype)[0]

    x = hidden_states.to(compute_dtype)
    if fake_quant:
        x = fake_quantize(x, quant, a13_scale)
    expert_of_pair = topk_ids.reshape(-1).long()
    token_of_pair = torch.arange(num_tokens * top_k, device=x.device) // top_k
    pairs_of_expert = {int(e): (expert_of_pair == e).nonzero().squeeze(1) for e in expert_of_pair.unique()}

    act = torch.empty(num_tokens * top_k, inter, dtype=compute_dtype, device=x.device)
    for expert, pairs in pairs_of_expert.items():
        gate_up = x[token_of_pair[pairs]] @ expert_weight(w13, w13_scale, expert).T
        act[pairs] = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    if fake_quant:
        act = fake_quantize(act, quant, a2_scale)

    out = torch.empty(num_tokens * top_k, w2.shape[1], dtype=compute_dtype, device=x.device)
    for expert, pairs in pairs_of_expert.items():
        out[pairs] = act[pairs] @ expert_weight(w2, w2_scale, expert).T
    weights = topk_weights.to(compute_dtype).unsqueeze(-1)
    return (out.view(num_tokens, top_k, -1) * weights).sum(dim=1)
