"""On-disk formats: tensor names beside each quantized weight and the `quantization_config`."""

from __future__ import annotations

import torch

from quantize_moe.errors import UserError
from quantize_moe.moe.quant_spec import UNQUANTIZED, MoEQuantSpec


class NativeFp8Format:
    """vLLM/SGLang `quant_method: "fp8"`: fp8 `weight` plus a float32 scalar `weight_scale`.

    Every Linear left in high precision is listed in `ignored_layers` by its exact
    module name, since a serialized-fp8 config means "every Linear is fp8".
    """

    name = "fp8"
    scale_suffix = "weight_scale"

    def scale_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def quantization_config(self, ignored_modules: list[str]) -> dict:
        return {"quant_method": "fp8", "activation_scheme": "dynamic",
                "ignored_layers": sorted(ignored_modules)}


FORMATS = {fmt.name: fmt for fmt in (NativeFp8Format(),)}


def read_quantization(raw_config: dict, where: str) -> tuple[MoEQuantSpec, str | None]:
    """What a checkpoint's `quantization_config` says about its experts: the layer's quant spec and
    the suffix of the scale tensors (None for an unquantized checkpoint). Reads our own output and
    the formats other tools write (AutoFP8, llm-compressor, DeepSeek block FP8)."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return UNQUANTIZED, None
    method = qc.get("quant_method")
    if method == "mxfp4":
        raise UserError(f"{where} says the checkpoint is MXFP4 (the gpt-oss release format), which "
                        "quantize-moe does not read; use a bf16 copy (e.g. openai's *-BF16 conversions, or load "
                        "it in transformers with Mxfp4Config(dequantize=True) and save_pretrained).")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block:
            return MoEQuantSpec("block", "group", tuple(block)), "weight_scale_inv"
        return MoEQuantSpec("tensor", "token"), "weight_scale"
    if method == "compressed-tensors":
        weights = next(iter(qc.get("config_groups", {}).values()), {}).get("weights") or {}
        strategy = weights.get("strategy")
        if strategy == "tensor":
            return MoEQuantSpec("tensor", "token"), "weight_scale"
        if strategy == "channel":
            return MoEQuantSpec("channel", "token"), "weight_scale"
        if strategy == "block":
            return MoEQuantSpec("block", "group", tuple(weights.get("block_structure") or (128, 128))), \
                "weight_scale"
    raise UserError(f"{where} has a quantization_config (quant_method {method!r}) that quantize-moe "
                    "cannot read; it reads fp8 and compressed-tensors FP8 checkpoints.")
