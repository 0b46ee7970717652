"""Per-architecture adapters, found by `model_type` in config.json."""

from __future__ import annotations

from huggingface_hub.errors import StrictDataclassError
from transformers import CONFIG_MAPPING, PretrainedConfig

from quantize_moe.adapters.base import Kind, MoELayerInfo, PerExpertFamily, TensorRole
from quantize_moe.adapters.families import FAMILIES
from quantize_moe.errors import UserError

__all__ = ["Kind", "MoELayerInfo", "PerExpertFamily", "TensorRole", "adapter_for", "parse_config",
           "supported_model_types"]

_BY_MODEL_TYPE = {t: family for family in FAMILIES for t in family.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def adapter_for(raw_config: dict, where: str = "config.json") -> PerExpertFamily:
    model_type = raw_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in _BY_MODEL_TYPE:
        raise UserError(f"{where} has model_type '{model_type}', which quantize-moe does not support; "
                        f"supported families: {', '.join(supported_model_types())} "
                        "(docs/adding-a-family.md says how to add one).")
    return _BY_MODEL_TYPE[model_type]


def parse_config(raw_config: dict, family: PerExpertFamily, where: str = "config.json") -> PretrainedConfig:
    """Parse config.json with transformers' own config class for the family (no remote code)."""
    model_type = family.config_model_type if raw_config["model_type"] not in CONFIG_MAPPING else None
    config_class = CONFIG_MAPPING[model_type or raw_config["model_type"]]
    # transformers writes inf/nan as {"__float__": "Infinity"} (GraniteMoeHybrid's time_step_limit)
    fields = config_class._decode_special_floats({k: v for k, v in raw_config.items() if k != "auto_map"})
    try:
        return config_class.from_dict(fields)
    except (TypeError, ValueError, StrictDataclassError) as e:  # transformers 5 validates fields strictly
        raise UserError(f"{where} could not be parsed as a {family.name} config ({e}); "
                        "restore the original config.json.") from None
