"""The calibrated outputs of a plan (`--activations static`, `--kv-cache fp8`): which attention the KV cache
can be scaled for, and which measured amax each `input_scale` / `k_scale` / `v_scale` output takes."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from quantize_moe.adapters import Kind, PerExpertFamily, TensorRole
from quantize_moe.adapters.base import text_config
from quantize_moe.errors import UserError
from quantize_moe.plan.options import Options
from quantize_moe.quantization.formats import INPUT_SCALE
from quantize_moe.quantization.static import KV_SCALES, W2, W13, ActivationAmax, input_scale


def calibrated_values(plan, amax: ActivationAmax) -> dict[str, torch.Tensor]:
    """The value of every calibrated output of `plan` (its items without sources: with --activations static
    one after each quantized item, its group's input scales; with --kv-cache fp8 one per attention layer,
    k_scale and v_scale): amax/448 of what its input was measured at."""
    roles = {d.role.module: d.role for d in plan.decisions.values() if d.quantize}
    values = {}
    for item in plan.items:
        if not item.sources:
            measured = _scale_amax([o.name for o in item.outputs], roles, amax)
            values.update({o.name: torch.full(o.shape, input_scale(measured[o.name]), dtype=o.dtype)
                           for o in item.outputs})
    return values

def _scale_amax(names: list[str], roles: dict[str, TensorRole], amax: ActivationAmax) -> dict[str, float]:
    """The amax behind each calibrated output of one work item: the k and v of one attention layer, or the
    input scales of one scale group, which share the largest amax of its members (they see one input)."""
    if names[0].endswith(KV_SCALES):
        return {name: _measured_kv(amax, name) for name in names}
    shared = max(_measured(amax, roles[name.removesuffix(f".{INPUT_SCALE}")]) for name in names)
    return dict.fromkeys(names, shared)


def _measured(amax: ActivationAmax, role: TensorRole) -> float:
    if role.kind == Kind.ROUTED_EXPERT:
        value = amax.experts.get((role.layer, role.expert, W2 if role.shard_id == "w2" else W13))
    else:
        value = amax.linears.get(role.module)
    if value is None:
        raise UserError(f"Calibration measured no input of '{role.module}' (transformers' model of this family "
                        "never ran it under that name); use --activations dynamic.")
    return value


def _measured_kv(amax: ActivationAmax, name: str) -> float:
    if name not in amax.kv:
        raise UserError(f"Calibration measured no keys and values for '{name}' (transformers' model of this family "
                        "names its attention differently); leave out --kv-cache.")
    return amax.kv[name]


# Attention that vLLM does not give per-tensor k/v scales: MLA caches a compressed latent, linear attention
# and Mamba mixers keep a state instead of keys and values.
UNSCALED_LAYER_TYPES = ("linear_attention", "mamba", "mamba2")


def check_calibrated_outputs(options: Options, family: PerExpertFamily, config: PretrainedConfig, where: str) -> None:
    """What calibrated outputs cannot be written for: static input scales of fused expert tensors, KV-cache
    scales of attention vLLM does not scale per key and value."""
    if options.activations == "static" and family.fused:
        raise UserError(f"{where} is a {family.name} checkpoint with fused expert tensors, for which static input "
                        "scales are not written; use --activations dynamic.")
    if options.kv_cache:
        _check_kv_cache(config, where)


def kv_cache_modules(family: PerExpertFamily, config: PretrainedConfig, names, where: str) -> list[str]:
    """The attention module of every decoder layer that has one, as the checkpoint names it (the module of
    its k_proj, beside which vLLM reads `<module>.k_scale`: `language_model.model.layers.{i}.self_attn`
    in a multimodal Llama-4), in layer order; multi-token-prediction layers are not run, so not scaled."""
    skipped = set(family.mtp_layers(config))
    layers = {name.removesuffix(".k_proj.weight"): family.layer_of(name) for name in names
              if name.endswith(".k_proj.weight") and family.layer_of(name) not in (None, *skipped)}
    if not layers:
        raise UserError(f"{where}: no decoder layer of the checkpoint has an attention module with a k_proj "
                        "(fused q/k/v projections), beside which vLLM reads k_scale / v_scale; leave out --kv-cache.")
    return sorted(layers, key=lambda module: (layers[module], module))


def _check_kv_cache(config: PretrainedConfig, where: str) -> None:
    config = text_config(config)  # a multimodal wrapper describes its decoder there
    if getattr(config, "kv_lora_rank", None):
        raise UserError(f"{where} describes multi-head latent attention (kv_lora_rank), whose cache vLLM does not "
                        "scale per key and value; leave out --kv-cache.")
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or []
    unscaled = sorted(set(types) & set(UNSCALED_LAYER_TYPES))
    if unscaled:
        raise UserError(f"{where} has {unscaled[0]} layers (linear attention or Mamba mixers), which keep a state "
                        "instead of a key/value cache that vLLM scales; leave out --kv-cache.")


