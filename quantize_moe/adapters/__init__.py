"""Per-architecture adapters, found by `model_type` in config.json, or the generic adapter when asked for."""

from __future__ import annotations

from collections.abc import Iterable

from transformers import CONFIG_MAPPING, PretrainedConfig

from quantize_moe.adapters.base import (ConfigFieldError, Kind, MoELayerInfo, PerExpertFamily, TensorRole, config_int,
                                        text_config)
from quantize_moe.adapters.families import FAMILIES
from quantize_moe.adapters.file_config import FileConfig, parse_file_config, parse_with
from quantize_moe.adapters.generic import GENERIC, GenericFamily, NoExpertPattern, detect
from quantize_moe.errors import UsageError, UserError
from quantize_moe.quantization.formats import read_quantization

__all__ = ["ADAPTERS", "Kind", "MoELayerInfo", "PerExpertFamily", "TensorRole", "adapter_for", "is_known",
           "parse_config", "supported_model_types"]

_BY_MODEL_TYPE = {t: family for family in FAMILIES for t in family.model_types}
ADAPTERS = (GENERIC,)  # the values of --adapter: an explicit choice instead of the model_type's family


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def is_known(raw_config: dict) -> bool:
    model_type = raw_config.get("model_type")
    return isinstance(model_type, str) and model_type in _BY_MODEL_TYPE


def adapter_for(raw_config: dict, where: str = "config.json", tensors: dict | None = None,
                adapter: str | None = None) -> PerExpertFamily:
    """The family of `model_type`, or with `adapter="generic"` the one `tensors` (name -> TensorInfo)
    show. An unknown model_type whose tensors show a per-expert layout is refused with the option
    that opts in: the generic adapter is never used silently."""
    if adapter is not None and adapter not in ADAPTERS:
        raise UsageError(f"--adapter {adapter} is not available; choose {', '.join(ADAPTERS)}, or leave it out "
                         "to use the family of config.json's model_type.")
    if adapter is None and is_known(raw_config):
        return _BY_MODEL_TYPE[raw_config["model_type"]]
    shapes = {name: tuple(info.shape) for name, info in (tensors or {}).items()}
    try:
        family = detect(raw_config, shapes, where)
    except NoExpertPattern as e:
        if is_known(raw_config):
            raise UserError(f"--adapter generic recognises no per-expert MoE layout in the tensors of the checkpoint "
                            f"of {where} ({e}); leave --adapter out to use its family's adapter.") from None
        raise UserError(f"{where} has model_type '{raw_config.get('model_type')}', which quantize-moe does not "
                        f"support, and the generic adapter recognises no per-expert MoE layout ({e}); "
                        f"supported families: {', '.join(supported_model_types())} "
                        "(docs/adding-a-family.md says how to add one).") from None
    if adapter is None:
        raise UserError(f"{where} has model_type '{raw_config.get('model_type')}', which quantize-moe does not "
                        "support, but its tensors show a per-expert MoE layout; pass --adapter generic to use the "
                        "generic adapter (`quantize-moe inspect` shows what it would do), or add the family "
                        "(docs/adding-a-family.md).")
    return family


def parse_config(raw_config: dict, family: PerExpertFamily, where: str, tensor_names: Iterable[str]) -> PretrainedConfig:
    """Parse config.json as its family's config (no remote code; `file_config`: the family's transformers
    config class only for what the file does not hold), and check that its decoder layers are in the
    checkpoint (`tensor_names`)."""
    read_quantization(raw_config, where)  # first: transformers' config classes crash on a damaged one
    # transformers writes inf/nan as {"__float__": "Infinity"} (GraniteMoeHybrid's time_step_limit)
    fields = PretrainedConfig._decode_special_floats({k: v for k, v in raw_config.items() if k != "auto_map"})
    if isinstance(family, GenericFamily):  # no config class knows the keys: keep them all as attributes
        config = parse_with(PretrainedConfig, fields, family.name, where)
    else:
        model_type = family.config_model_type if raw_config["model_type"] not in CONFIG_MAPPING else None
        config = parse_file_config(fields, model_type or raw_config["model_type"], family.name, where)
    try:
        _check_layer_count(config, family, where, tensor_names)
        layers, _ = family.moe_layers(config), family.mtp_layers(config)
    except ConfigFieldError as e:
        if isinstance(config, FileConfig):  # the family's class refuses a bad field first, as it did before
            config.parsed_by_family()
        raise UserError(f"{where} {e}; restore the original config.json.") from None
    _check_top_k(layers, family, where)
    return config


def _check_top_k(layers: list[MoELayerInfo], family: PerExpertFamily, where: str) -> None:
    """Each token picks top_k of the layer's experts: more than there are is no model."""
    for info in layers:
        if info.top_k is not None and not 1 <= info.top_k <= info.num_experts:
            raise UserError(f"{where} makes each token pick {info.top_k} experts ({family.top_k_keys[0]}) in layer "
                            f"{info.layer}, which has {info.num_experts}; restore the original config.json.")


def _check_layer_count(config: PretrainedConfig, family: PerExpertFamily, where: str,
                       tensor_names: Iterable[str]) -> None:
    """Every per-layer walk runs to num_hidden_layers: a count beyond the layers on disk (an absurd one
    would never finish) means the config does not belong to these weights."""
    declared = config_int(text_config(config), "num_hidden_layers")
    on_disk = 1 + max((layer for name in tensor_names if (layer := family.layer_of(name)) is not None), default=-1)
    if declared is not None and declared > on_disk:
        raise UserError(f"{where} declares {declared} decoder layers (num_hidden_layers), but the checkpoint's "
                        f"tensors hold {on_disk}; restore the config.json that belongs to these weights.")
