"""On-disk formats: tensor names beside each quantized weight and the `quantization_config`."""

from __future__ import annotations

import torch


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
