"""`FusedMoE`: one module owning all routed experts of one MoE layer.

Its parameters are created by a quantization-method object and filled through
one weight loader keyed by (shard id, expert id), the contract of vLLM's FusedMoE
weight loader: the original and the quantized checkpoint load the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from quantize_moe.errors import UserError
from quantize_moe.moe.methods import INPUT_SCALE, ROW_SCALE, TENSOR_SCALE, WEIGHT, FusedMoEMethodBase


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, expert_width: int, method: FusedMoEMethodBase,
                 params_dtype: torch.dtype = torch.bfloat16, name: str = "moe"):
        super().__init__()
        self.num_experts, self.hidden_size, self.expert_width = num_experts, hidden_size, expert_width
        self.quant_method = method
        self.name = name
        method.create_weights(self, num_experts, hidden_size, expert_width, params_dtype)
        self._loaded: set[tuple[str, int, str]] = set()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str,
                      shard_id: str, expert_id: int) -> None:
        """Copy one checkpoint tensor of expert `expert_id`, shard w1 (gate), w3 (up) or w2 (down); a static
        input scale of w1 and w3 lands in the expert's one w13 input scale, so the two must agree."""
        target = self.shard_target(param, weight_name, shard_id, expert_id)
        if loaded_weight.numel() != target.numel():
            raise UserError(f"{self.name}: expert {expert_id} {shard_id} tensor for {weight_name} has shape "
                            f"{tuple(loaded_weight.shape)}, expected {tuple(target.shape)}.")
        other = {"w1": "w3", "w3": "w1"}.get(shard_id)
        if param.shard_kind == INPUT_SCALE and (weight_name, expert_id, other) in self._loaded and \
                not torch.isclose(target, loaded_weight.reshape(()).to(target.dtype), rtol=1e-5, atol=0):
            # gate and up see the same input, and the engines' w13 GEMM quantizes it once (vLLM refuses too)
            raise UserError(f"{self.name}: expert {expert_id} has input scales {target.item():.6g} ({other}) and "
                            f"{loaded_weight.item():.6g} ({shard_id}); gate and up must carry the same input_scale.")
        target.copy_(loaded_weight.reshape(target.shape))
        self.mark_loaded(weight_name, shard_id, expert_id)

    def shard_target(self, param: nn.Parameter, weight_name: str, shard_id: str, expert_id: int) -> torch.Tensor:
        """The part of `param` that expert `expert_id`'s shard fills: what `weight_loader` copies into, and
        where a caller reading the checkpoint's bytes in place puts them (then `mark_loaded`)."""
        if shard_id not in ("w1", "w2", "w3"):
            raise ValueError(f"shard_id must be w1, w2 or w3, not {shard_id!r}")
        if (shard_id == "w2") != weight_name.startswith("w2_"):
            raise ValueError(f"shard {shard_id} does not belong in {weight_name}")
        target = param.data[expert_id]
        if param.shard_kind == TENSOR_SCALE:
            return target if shard_id == "w2" else target[0 if shard_id == "w1" else 1]
        if param.shard_kind in (WEIGHT, ROW_SCALE) and shard_id != "w2":
            half = target.shape[0] // 2
            return target[:half] if shard_id == "w1" else target[half:]
        return target

    def mark_loaded(self, weight_name: str, shard_id: str, expert_id: int) -> None:
        self._loaded.add((weight_name, expert_id, shard_id))

    def check_loaded(self) -> None:
        """Every parameter got every expert's w1, w3 (w13 params) or w2 (w2 params)."""
        for weight_name, _ in self.named_parameters():
            shards = ("w2",) if weight_name.startswith("w2_") else ("w1", "w3")
            for expert in range(self.num_experts):
                for shard in shards:
                    if (weight_name, expert, shard) not in self._loaded:
                        raise UserError(f"{self.name}: expert {expert} has no {shard} tensor for "
                                        f"{weight_name} in the checkpoint.")

    def process_weights_after_loading(self) -> None:
        self.check_loaded()
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                use_kernels: bool | None = None) -> torch.Tensor:
        if use_kernels is None:
            use_kernels = x.is_cuda
        return self.quant_method.apply(self, x, topk_weights, topk_ids, use_kernels=use_kernels)
