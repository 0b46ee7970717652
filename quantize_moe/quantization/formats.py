"""On-disk formats: tensor names beside each quantized weight and the `quantization_config`.

Native fp8 is what vLLM and SGLang read as `quant_method: "fp8"` (per-tensor
`weight_scale`, or DeepSeek-style 128x128 `weight_scale_inv`, which transformers
reads too); compressed-tensors is llm-compressor's format. Which engine loads
which combination is in `engines.py`.
"""

from __future__ import annotations

import re

import torch

from quantize_moe.errors import UserError
from quantize_moe.quantization.spec import UNQUANTIZED, MoEQuantSpec
from quantize_moe.quantization.schemes import SCHEMES, Scheme
from quantize_moe.quantization.static import KV_CACHE_SCHEME


class NativeFp8Format:
    """`quant_method: "fp8"`: fp8 `weight` plus a float32 per-tensor `weight_scale` or block `weight_scale_inv`.

    Every Linear left in high precision is listed by its exact module name, since a
    serialized-fp8 config means "every Linear is fp8": under `ignored_layers` for
    vLLM/SGLang and, with block scales, also under `modules_to_not_convert`, which
    replaces transformers' own skip list and so must name `lm_head` too.
    """

    name = "fp8"
    schemes = ("tensor", "block")

    def scale_suffix(self, scheme: Scheme) -> str:
        return "weight_scale_inv" if scheme.name == "block" else "weight_scale"

    def scale_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def scale_shape(self, scheme: Scheme, shape: tuple[int, ...]) -> tuple[int, ...]:
        return scheme.scale_shape(shape)

    def quantization_config(self, scheme: Scheme, ignored: list[str], quantized: list[str],
                            activations: str = "dynamic", kv_cache: bool = False) -> dict:
        # vLLM's Fp8Config reads no KV-cache key: it loads `k_scale`/`v_scale` when present and uses them
        # under `--kv-cache-dtype fp8`; the scheme is written so that readers can tell the scales are there.
        kv = {"kv_cache_scheme": dict(KV_CACHE_SCHEME)} if kv_cache else {}
        if scheme.name != "block":
            return {"quant_method": "fp8", "activation_scheme": activations, "ignored_layers": ignored, **kv}
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": activations,
                "weight_block_size": list(scheme.block), "modules_to_not_convert": ignored,
                "ignored_layers": ignored, **kv}


class CompressedTensorsFormat:
    """llm-compressor's `compressed-tensors` float-quantized format, with dynamic or static activations.

    Scales are stored in the model's dtype, as compressed-tensors writes them; a per-tensor
    scale is a 1-element vector. Activations are quantized dynamically (per token; per tensor
    under tensor weights; per 128-channel group under block weights), so no calibration data
    is needed; static activations (`--activations static`) carry a calibrated per-tensor `input_scale`
    shaped and typed like a per-tensor weight scale.
    """

    name = "compressed-tensors"
    schemes = ("tensor", "channel", "block")

    def scale_suffix(self, scheme: Scheme) -> str:
        return "weight_scale"

    def scale_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    def scale_shape(self, scheme: Scheme, shape: tuple[int, ...]) -> tuple[int, ...]:
        return scheme.scale_shape(shape) or (1,)

    def quantization_config(self, scheme: Scheme, ignored: list[str], quantized: list[str],
                            activations: str = "dynamic", kv_cache: bool = False) -> dict:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": scheme.name, "group_size": None, "block_structure": None}
        # static activations come with tensor weights only (plan/compatibility): strategy tensor below
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": activations != "static",
                       "strategy": "token", "group_size": None}
        if scheme.name == "block":
            weights["block_structure"] = list(scheme.block)
            activations.update(strategy="group", group_size=scheme.block[1])
        elif scheme.name == "tensor":  # vLLM's MoE method takes tensor weights with tensor activations only
            activations["strategy"] = "tensor"
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                              "weights": weights, "input_activations": activations,
                                              "output_activations": None}},
                "ignore": ignore_entries(ignored, quantized),
                "kv_cache_scheme": dict(KV_CACHE_SCHEME) if kv_cache else None}


def ignore_entries(ignored: list[str], quantized: list[str]) -> list[str]:
    """compressed-tensors `ignore` list: one anchored `re:` pattern per name shape that repeats across
    layers (`model.layers.0.mlp.gate`, `model.layers.1.mlp.gate` -> `re:model\\.layers\\.\\d+\\.mlp\\.gate$`)
    when it matches no quantized module, otherwise the exact names. compressed-tensors matches `re:`
    entries with `re.match`, so the start is anchored already and `$` anchors the end."""
    by_pattern: dict[str, list[str]] = {}
    for name in ignored:
        by_pattern.setdefault(re.sub(r"\d+", r"\\d+", re.escape(name)) + "$", []).append(name)
    entries = []
    for pattern, names in by_pattern.items():
        if len(names) > 1 and not any(re.match(pattern, q) for q in quantized):
            entries.append(f"re:{pattern}")
        else:
            entries.extend(names)
    return entries


FORMATS = {fmt.name: fmt for fmt in (NativeFp8Format(), CompressedTensorsFormat())}


INPUT_SCALE = "input_scale"  # `<module>.input_scale`: the static activation scale of a quantized Linear's input

_COMPRESSED_ACTIVATIONS = {(True, "token"): "token", (True, "tensor"): "tensor", (True, "group"): "group",
                           (False, "tensor"): "static"}


def read_quantization(raw_config: dict, where: str) -> tuple[MoEQuantSpec, str | None]:
    """What a checkpoint's `quantization_config` says about its experts: the layer's quant spec (weights
    and input activations: dynamic per token, tensor or group, or static per tensor) and the suffix of
    the scale tensors (None for an unquantized checkpoint). Reads our own output and the formats other
    tools write (AutoFP8, llm-compressor, DeepSeek block FP8); every field it reads is checked for its
    type, so a damaged config is a sentence naming the field."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return UNQUANTIZED, None
    qc = _object(qc, "quantization_config", where)
    method = qc.get("quant_method")
    if method == "mxfp4":
        raise UserError(f"{where} says the checkpoint is MXFP4 (the gpt-oss release format), which "
                        "quantize-moe does not read; use a bf16 copy (e.g. openai's *-BF16 conversions, or load "
                        "it in transformers with Mxfp4Config(dequantize=True) and save_pretrained).")
    if method == "fp8":
        block = qc.get("weight_block_size")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise UserError(f"{where} has activation_scheme {scheme!r}; native fp8 activations are 'dynamic' "
                            "or 'static'.")
        if block is not None:
            return _spec(where, "block", "static" if scheme == "static" else "group",
                         _block(block, "weight_block_size", where)), "weight_scale_inv"
        spec = SCHEMES["tensor"].moe_spec
        return (_spec(where, "tensor", "static") if scheme == "static" else spec), "weight_scale"
    if method == "compressed-tensors":
        groups = _object(qc.get("config_groups", {}), "quantization_config.config_groups", where)
        group = _object(next(iter(groups.values()), {}), "quantization_config.config_groups entry", where)
        weights = _object(group.get("weights") or {}, "quantization_config.config_groups weights", where)
        strategy = weights.get("strategy")
        if strategy in ("tensor", "channel", "block"):
            block = _block(weights.get("block_structure") or [128, 128], "block_structure", where) \
                if strategy == "block" else None
            activations = group.get("input_activations")
            if not activations:  # weight-only: engines still quantize the activations of FP8 GEMMs dynamically
                return SCHEMES[strategy].moe_spec if block is None else _spec(where, "block", "group", block), \
                    "weight_scale"
            activations = _object(activations, "quantization_config.config_groups input_activations", where)
            key = (activations.get("dynamic") is not False, activations.get("strategy"))
            if key not in _COMPRESSED_ACTIVATIONS:
                raise UserError(f"{where} declares {'dynamic' if key[0] else 'static'} input activations with "
                                f"strategy {key[1]!r}, which quantize-moe cannot run; it reads dynamic token, "
                                "tensor or group activations and static tensor ones.")
            return _spec(where, strategy, _COMPRESSED_ACTIVATIONS[key], block), "weight_scale"
    raise UserError(f"{where} says the checkpoint is already quantized ({method}), in a format quantize-moe "
                    "cannot dequantize (it reads fp8 and compressed-tensors FP8 only); point SRC at the "
                    "bf16/fp16/fp32 original.")


def reads_kv_cache(raw_config: dict, where: str) -> bool:
    """Whether the checkpoint declares an FP8 KV cache (`kv_cache_scheme`, written by both formats) with
    per-tensor `k_scale`/`v_scale` per attention layer; another KV-cache scheme is one sentence."""
    qc = raw_config.get("quantization_config")
    scheme = qc.get("kv_cache_scheme") if isinstance(qc, dict) else None
    if scheme is None:
        return False
    scheme = _object(scheme, "quantization_config.kv_cache_scheme", where)
    if any(scheme.get(key) != KV_CACHE_SCHEME[key] for key in ("num_bits", "type", "strategy")) \
            or scheme.get("dynamic") not in (False, None):
        raise UserError(f"{where} declares a kv_cache_scheme {scheme!r:.120} that quantize-moe cannot run; it reads "
                        "a static per-tensor FP8 KV cache (8-bit float, strategy 'tensor') only.")
    return True


def _object(value, field: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise UserError(f"{where} has a {field} that is {type(value).__name__} {value!r:.60}, not an object; "
                        "restore the original config.json.")
    return value


def _block(value, field: str, where: str) -> tuple[int, int]:
    """A block shape [rows, columns] of positive whole numbers."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)):
        raise UserError(f"{where} has quantization_config {field} {value!r:.60}, which is not two positive whole "
                        "numbers such as [128, 128]; restore the original config.json.")
    return tuple(value)


def _spec(where: str, weight: str, activation: str, block: tuple[int, int] | None = None) -> MoEQuantSpec:
    """The spec, or one sentence for a combination no engine runs (e.g. static activations with block
    weights: vLLM takes static activation scales with per-tensor weights only)."""
    try:
        return MoEQuantSpec(weight, activation, block)
    except ValueError as error:
        raise UserError(f"{where} declares {weight} weights with {activation} activations, which quantize-moe "
                        f"cannot run ({error}).") from None
