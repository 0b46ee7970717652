"""What an adapter tells the rest of the tool about one MoE family.

Every tensor of a checkpoint gets a `TensorRole`: a routed expert projection
(with its layer, expert and vLLM shard id, or the `FusedLayout` of a tensor that
holds every expert), a shared-expert or dense Linear, or something that must stay
in high precision, with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

import torch
from transformers import PretrainedConfig

from quantize_moe.adapters.fused import FusedLayout
from quantize_moe.errors import UserError
from quantize_moe.moe.routing import RoutingRule, Scoring

# vLLM's FusedMoE shard ids: gate = w1, down = w2, up = w3.
SHARD_IDS = ("w1", "w2", "w3")


class Kind(str, Enum):
    ROUTED_EXPERT = "routed expert"
    SHARED_EXPERT = "shared expert"
    LINEAR = "linear"
    ROUTER = "router"
    HIGH_PRECISION = "high precision"


@dataclass(frozen=True)
class TensorRole:
    kind: Kind
    module: str  # module name: the tensor name without its parameter suffix
    is_linear_weight: bool  # a 2-D Linear weight (quantizable in principle)
    reason: str = ""  # why it stays in high precision, if it does
    layer: int | None = None
    expert: int | None = None
    shard_id: str | None = None  # w1 / w2 / w3 for routed experts
    fused: FusedLayout | None = None  # for a tensor holding one projection of every expert


class ConfigFieldError(UserError):
    """A config.json field the adapters read has the wrong type; `parse_config` names the file."""


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (the config itself, or its `text_config`), refusing one that is not a config."""
    try:
        text = config.get_text_config()
    except ValueError as e:  # several candidate sub-configs
        raise ConfigFieldError(f"has more than one text config ({e})") from None
    if not isinstance(text, PretrainedConfig):
        raise ConfigFieldError(f"field 'text_config' is {text!r}, not an object of model settings")
    return text


def config_int(config, key: str, default: int | None = None, layer: int | None = None) -> int | None:
    """An integer field of a config (dotted keys reach into sub-configs; a per-layer list gives the entry
    of `layer`), `default` when it is absent or null: the one way adapters read counts, so a field of the
    wrong type (`"8"`, a list, nested garbage) is a sentence naming it instead of a crash later."""
    value = config
    for part in key.split("."):
        value = getattr(value, part, None) if not isinstance(value, dict) else value.get(part)
    if isinstance(value, (list, tuple)) and layer is not None:
        value = value[layer] if layer < len(value) else None
        key = f"{key}[{layer}]"
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigFieldError(f"field '{key}' is {value!r}, not a whole number of at least 0")
    return value


def config_ints(config, key: str) -> list[int]:
    """A list of whole numbers (layer indices such as `mlp_only_layers`), empty when absent or null."""
    value = getattr(config, key, None)
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ConfigFieldError(f"field '{key}' is {value!r}, not a list of whole numbers")
    return list(value)


@dataclass(frozen=True)
class MoELayerInfo:
    layer: int
    num_experts: int
    hidden_size: int
    expert_width: int  # I: rows of gate and of up, columns of down
    top_k: int


@dataclass(frozen=True)
class PerExpertFamily:
    """An MoE family: where its routed experts, routers and shared experts are on disk.

    Routed experts are either one 2-D Linear per expert and projection (`experts`,
    whose `(?P<proj>...)` group names the projection) or fused tensors holding every
    expert (`fused`). Templates are regular expressions relative to one decoder
    layer (`{layers}.{L}.`), except `keep_modules`, which match whole module names.
    """

    name: str
    model_types: tuple[str, ...]
    experts: str = ""  # e.g. r"block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<proj>w1|w3|w2)"
    projections: dict[str, str] = field(default_factory=dict)  # on-disk projection name -> shard id
    routers: tuple[str, ...] = ()  # module patterns of routers (stay high precision)
    fused: tuple[FusedLayout, ...] = ()  # fused expert tensors, instead of `experts`
    shared_experts: tuple[str, ...] = ()  # module patterns of shared-expert Linears
    keep_linears: tuple[tuple[str, str], ...] = ()  # (module pattern, reason): other Linears that stay
    keep_modules: tuple[tuple[str, str], ...] = ()  # (whole-name pattern, reason): e.g. a vision tower
    # (format, scheme, module pattern, reason): Linears that stay in high precision in that combination only
    keep_linears_in: tuple[tuple[str, str, str, str], ...] = ()
    layers: str = r"model\.layers"
    activation: str = "silu"  # of the experts' GLU: "silu", or gpt-oss's clamped "swigluoai"
    # Engines known to load this family's FP8 output; empty with a reason when none does.
    fp8_loads_in: str = "vLLM, SGLang"
    fp8_refusal: str = ""
    config_model_type: str | None = None  # transformers config class to parse with, when model_type has none
    num_experts_keys: tuple[str, ...] = ("num_local_experts",)
    expert_width_keys: tuple[str, ...] = ("moe_intermediate_size", "intermediate_size")
    top_k_keys: tuple[str, ...] = ("num_experts_per_tok",)
    # Routing (moe/routing.py): how the router's logits pick experts; renormalized always (True), never
    # (False) or as the named config flag says.
    scoring: Scoring = "softmax_topk"
    renormalize: bool | str = True
    routing_note: str = ""  # set when the rule is a guess (the generic adapter), for validate to say so
    moe_input_norm: str = "post_attention_layernorm"  # the norm whose output enters the MoE block
    zero_centered_norm: bool = False  # that norm multiplies by 1 + weight (Qwen3-Next), not by weight
    _patterns: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        layer = rf"^(?P<prefix>{self.layers}\.(?P<layer>\d+))\."
        compiled = self._patterns
        compiled["layer"] = re.compile(layer)
        compiled["expert"] = re.compile(layer + self.experts + r"\.weight$") if self.experts else None
        compiled["fused"] = [(re.compile(layer + f.name + "$"), f) for f in self.fused]
        compiled["keep_whole"] = [(re.compile(p), why) for p, why in self.keep_modules]
        compiled["router"] = [re.compile(layer + p + "$") for p in self.routers]
        compiled["shared"] = [re.compile(layer + p + r"\.") for p in self.shared_experts]
        compiled["keep"] = [(re.compile(layer + p + "$"), why) for p, why in self.keep_linears]
        compiled["keep_in"] = [(fmt, scheme, re.compile(layer + p + r"\.weight$"), why)
                               for fmt, scheme, p, why in self.keep_linears_in]

    # -- config -------------------------------------------------------------------------------
    def config_value(self, config: PretrainedConfig, keys: tuple[str, ...], layer: int = 0) -> int | None:
        """The first key present, through `config_int`: dotted keys reach into sub-configs (DBRX
        `ffn_config.*`), and a per-layer list (Hunyuan `moe_topk`) gives the layer's entry."""
        return next((v for key in keys if (v := config_int(config, key, layer=layer)) is not None), None)

    def is_moe_layer(self, config: PretrainedConfig, layer: int) -> bool:
        """Mixtral-like default: every decoder layer is MoE."""
        return True

    def moe_layers(self, config: PretrainedConfig) -> list[MoELayerInfo]:
        config = text_config(config)
        if not self.config_value(config, self.num_experts_keys):
            return []
        return [MoELayerInfo(layer=i, num_experts=self.config_value(config, self.num_experts_keys, i),
                             hidden_size=config_int(config, "hidden_size"),
                             expert_width=self.config_value(config, self.expert_width_keys, i),
                             top_k=self.config_value(config, self.top_k_keys, i))
                for i in range(config_int(config, "num_hidden_layers", 0)) if self.is_moe_layer(config, i)]

    def mtp_layers(self, config: PretrainedConfig) -> list[int]:
        """Multi-token-prediction layers that real DeepSeek-V3 / GLM checkpoints keep after the
        decoder layers (`num_nextn_predict_layers`); transformers' models do not build them."""
        config = text_config(config)
        layers = config_int(config, "num_hidden_layers", 0)
        return list(range(layers, layers + config_int(config, "num_nextn_predict_layers", 0)))

    def layer_of(self, name: str) -> int | None:
        """The decoder-layer index a tensor belongs to, if any."""
        m = self._patterns["layer"].match(name)
        return int(m["layer"]) if m else None

    def routing_rule(self, config: PretrainedConfig, router: dict[str, torch.Tensor], layer: int = 0) -> RoutingRule:
        """The family's top-k rule in decoder layer `layer`; `router` maps the names of the layer's router
        parameters (`weight`, and `bias` or `e_score_correction_bias` where the family has one) to tensors."""
        config = text_config(config)
        renormalize = self.renormalize if isinstance(self.renormalize, bool) else bool(
            getattr(config, self.renormalize, False))
        bias = router.get("e_score_correction_bias")
        return RoutingRule(self.scoring, top_k=self.config_value(config, self.top_k_keys, layer),
                           renormalize=renormalize, logit_bias=router.get("bias"),
                           e_score_correction_bias=None if bias is None else bias.reshape(-1))

    def layer_tensor(self, names, layer: int, relative: str) -> str | None:
        """The name among `names` of the tensor `relative` (a regex) inside decoder layer `layer`."""
        pattern = re.compile(rf"^{self.layers}\.{layer}\.{relative}$")
        return next((n for n in names if pattern.match(n)), None)

    # -- tensors ------------------------------------------------------------------------------
    def kept_in(self, name: str, fmt: str, scheme: str) -> str:
        """Why the Linear weight `name` stays in high precision under this format and scheme, or ""."""
        return next((why for f, s, pattern, why in self._patterns["keep_in"]
                     if (f, s) == (fmt, scheme) and pattern.match(name)), "")

    def written_as(self, name: str, shape: tuple[int, ...], num_experts: dict[int, int]) -> list[tuple[str, tuple]]:
        """(name, shape) of the tensors a source tensor is written as: itself, or one Linear per expert
        and projection for a fused layout that is written unfused (Llama-4); `num_experts` per MoE layer."""
        role = self.role(name, len(shape))
        if role.fused is None or not role.fused.unfused or role.layer not in num_experts:
            return [(name, tuple(shape))]
        return role.fused.expert_weights(name, num_experts[role.layer], tuple(shape))

    def role(self, name: str, ndim: int) -> TensorRole:
        """Classify one checkpoint tensor by its name and rank."""
        module, _, param = name.rpartition(".")
        linear = param == "weight" and ndim == 2
        if self._patterns["expert"] and (m := self._patterns["expert"].match(name)):
            return TensorRole(Kind.ROUTED_EXPERT, module, True, layer=int(m["layer"]),
                              expert=int(m["expert"]), shard_id=self.projections[m["proj"]])
        for pattern, layout in self._patterns["fused"]:
            if m := pattern.match(name):
                return TensorRole(Kind.ROUTED_EXPERT, module, True, layer=int(m["layer"]), fused=layout)
        for pattern, why in self._patterns["keep_whole"]:
            if pattern.match(module):
                return TensorRole(Kind.HIGH_PRECISION, module, linear, why)
        if m := next(filter(None, (p.match(module) for p in self._patterns["router"])), None):
            return TensorRole(Kind.ROUTER, module, linear, "router: top-k choices flip when it is quantized",
                              layer=int(m["layer"]))
        for pattern, why in self._patterns["keep"]:
            if pattern.match(module):
                return TensorRole(Kind.HIGH_PRECISION, module, linear, why)
        if not linear:
            return TensorRole(Kind.HIGH_PRECISION, module, False, _not_linear_reason(name, param, ndim))
        if "embed" in module or module.endswith("wte"):
            return TensorRole(Kind.HIGH_PRECISION, module, False, "embedding")
        if module.split(".")[-1] == "lm_head":
            return TensorRole(Kind.HIGH_PRECISION, module, True, "lm_head: output logits stay high precision")
        if any(p.match(name) for p in self._patterns["shared"]):
            return TensorRole(Kind.SHARED_EXPERT, module, True)
        return TensorRole(Kind.LINEAR, module, True)


def _not_linear_reason(name: str, param: str, ndim: int) -> str:
    if "bias" in param:
        return "bias"
    if ndim == 1 and param == "weight":
        return "norm or other 1-D weight"
    return f"not a 2-D Linear weight ({ndim}-D '{param}')"
