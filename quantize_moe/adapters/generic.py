"""The generic adapter: a per-expert MoE family recognised from tensor names and shapes alone.

For a checkpoint whose `model_type` no declared family knows, `detect` looks for one layout,
`<prefix>.<L>.<block>.experts.<j>.<proj>.weight` with three projections per expert, one router
`[E, H]` beside the experts and optional `shared_expert(s)`, and declares the `PerExpertFamily`
it implies. The tensors are the truth for counts and shapes; config.json values that disagree
with them are an error. It reads names, not the architecture, so it is used only when asked
for (`--adapter generic`), and its routing rule is a guess.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace

import torch
from transformers import PretrainedConfig

from quantize_moe.adapters.base import ConfigFieldError, MoELayerInfo, PerExpertFamily, config_int
from quantize_moe.errors import UserError
from quantize_moe.moe.routing import RoutingRule

GENERIC = "generic"

_EXPERT = re.compile(r"^(?P<layers>.+?)\.(?P<layer>\d+)\.(?P<block>(?:[^.]+\.)+?)experts\.(?P<expert>\d+)\."
                     r"(?P<proj>[^.]+)\.weight$")
_SHARED = re.compile(r"shared_experts?\.")
# Raw config keys per quantity, from ../shared/reference/moe-families.md; dotted keys reach into sub-dicts.
NUM_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                    "ffn_config.moe_num_experts")
EXPERT_WIDTH_KEYS = ("moe_intermediate_size", "ffn_config.ffn_hidden_size", "intermediate_size")
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "ffn_config.moe_top_k")
RENORMALIZE_KEY = "norm_topk_prob"


class NoExpertPattern(UserError):
    """The tensors show no per-expert layout the generic adapter can declare (the message says why)."""


@dataclass(frozen=True)
class GenericFamily(PerExpertFamily):
    """A `PerExpertFamily` declared by `detect`: its MoE layers are the ones with experts on disk."""

    detected: tuple[MoELayerInfo, ...] = ()

    def moe_layers(self, config: PretrainedConfig) -> list[MoELayerInfo]:
        mtp = set(self.mtp_layers(config))
        return [info for info in self.detected if info.layer not in mtp]

    def mtp_layers(self, config: PretrainedConfig) -> list[int]:
        return super().mtp_layers(config) if hasattr(config, "num_hidden_layers") else []

    def routing_rule(self, config: PretrainedConfig, router: dict[str, torch.Tensor], layer: int = 0) -> RoutingRule:
        top_k = next(info.top_k for info in self.detected if info.layer == layer)
        if top_k is None:
            raise UserError(f"config.json has none of {', '.join(TOP_K_KEYS)}, so the generic adapter cannot "
                            "route tokens to experts; add the model's top-k under num_experts_per_tok.")
        return replace(super().routing_rule(config, router, layer), top_k=top_k)


def detect(raw_config: dict, shapes: dict[str, tuple[int, ...]], where: str = "config.json") -> GenericFamily:
    """Declare the per-expert family the tensor names show, or raise `NoExpertPattern` saying why not."""
    experts = {name: m for name in shapes if len(shapes[name]) == 2 and (m := _EXPERT.match(name))}
    if not experts:
        raise NoExpertPattern("no tensor is named like '<prefix>.<layer>.<block>.experts.<j>.<proj>.weight'")
    layouts = sorted({(m["layers"], m["block"]) for m in experts.values()})
    if len(layouts) > 1:
        found = ", ".join(prefix + ".{L}." + block for prefix, block in layouts)
        raise NoExpertPattern(f"experts sit under more than one prefix ({found})")
    layers, block = layouts[0][0], layouts[0][1].rstrip(".")
    per_layer: dict[int, dict[tuple[int, str], tuple[int, ...]]] = defaultdict(dict)
    for name, m in experts.items():
        per_layer[int(m["layer"])][(int(m["expert"]), m["proj"])] = shapes[name]
    first = per_layer[min(per_layer)]
    projections = _projections({proj: shape for (expert, proj), shape in first.items() if expert == 0})
    down = next(p for p, shard in projections.items() if shard == "w2")
    routers, kept, detected = set(), [], []
    for layer, on_disk in sorted(per_layer.items()):
        num_experts = 1 + max(expert for expert, _ in on_disk)
        hidden, width = on_disk.get((0, down), (None, None))
        if hidden is None:
            raise NoExpertPattern(f"expert 0 of layer {layer} has no '{down}' weight")
        router, others = _block_siblings(shapes, f"{layers}.{layer}.{block}.", num_experts, hidden)
        routers.add(router)
        kept += others
        detected.append(MoELayerInfo(layer, num_experts, hidden, width,
                                     _check_config(raw_config, where, layer, num_experts, width, hidden)))
    top = re.escape(block)
    renormalize = bool(raw_config.get(RENORMALIZE_KEY))
    renormalized = "renormalized (norm_topk_prob is true)" if renormalize else \
        "not renormalized (config.json has no true norm_topk_prob)"
    gate, up = (next(p for p, shard in projections.items() if shard == s) for s in ("w1", "w3"))
    return GenericFamily(
        name=f"generic: {layers}.{{L}}.{block}.experts.{{j}}.{gate}/{up}/{down} as gate/up/down, "
             f"router {block}.{'/'.join(sorted(routers))}",
        model_types=(GENERIC,),
        experts=rf"{top}\.experts\.(?P<expert>\d+)\.(?P<proj>{'|'.join(map(re.escape, projections))})",
        projections=projections,
        routers=tuple(rf"{top}\.{re.escape(r)}" for r in sorted(routers)),
        shared_experts=(rf"{top}\.shared_experts?",),
        keep_modules=tuple((re.escape(module) + "$", why) for module, why in sorted(set(kept))),
        layers=re.escape(layers),
        fp8_loads_in="engines whose own model class for this architecture loads per-expert weight_scale "
                     "(quantize-moe does not know it)",
        renormalize=renormalize,  # decided here, so the rule and its note agree
        routing_note=f"the generic adapter guesses the routing: softmax top-k, {renormalized}",
        detected=tuple(detected),
    )


def _projections(shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Projection name -> shard id: down is the one stored [H, I] while gate and up are [I, H] (by name
    when I == H); gate and up only by name, as w1/w3 or *gate*/*up*: never guessed."""
    if len(shapes) != 3:
        raise NoExpertPattern(f"expert 0 has the projections {', '.join(sorted(shapes))}; the generic adapter "
                              "needs exactly three (gate, up, down)")
    by_shape = defaultdict(list)
    for proj, shape in shapes.items():
        by_shape[shape].append(proj)
    odd = [projs[0] for shape, projs in by_shape.items() if len(projs) == 1 and shape[::-1] in by_shape]
    if len(by_shape) == 1:
        odd = [p for p in shapes if "down" in p or p == "w2"]
    if len(odd) != 1:
        raise NoExpertPattern(f"the shapes of {', '.join(f'{p} {list(s)}' for p, s in sorted(shapes.items()))} "
                              "do not show which projection is down ([H, I] beside gate and up [I, H])")
    gate_up = sorted(p for p in shapes if p != odd[0])
    gates = [p for p in gate_up if ("gate" in p or p == "w1") and not ("up" in p or p == "w3")]
    ups = [p for p in gate_up if ("up" in p or p == "w3") and not ("gate" in p or p == "w1")]
    if len(gates) != 1 or len(ups) != 1:
        raise NoExpertPattern(f"the names {gate_up[0]} and {gate_up[1]} do not say which is gate and which is up "
                              "(w1/w3 or *gate*/*up*), and guessing would compute a different function")
    return {gates[0]: "w1", ups[0]: "w3", odd[0]: "w2"}


def _block_siblings(shapes: dict[str, tuple[int, ...]], block: str, num_experts: int,
                    hidden: int) -> tuple[str, list[tuple[str, str]]]:
    """The one router (a 2-D `[E, H]` weight beside the experts, relative to the block) and the other
    2-D weights there, which keep high precision with the reason."""
    routers, kept = [], []
    for name, shape in shapes.items():
        relative = name.removeprefix(block)
        if relative == name or relative.startswith("experts.") or _SHARED.match(relative) \
                or not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name.removesuffix(".weight")
        if shape == (num_experts, hidden):
            routers.append(relative.removesuffix(".weight"))
        elif "shared_expert_gate" in relative:
            kept.append((module, "shared_expert_gate: a 1-row gate on the shared expert"))
        else:
            kept.append((module, "beside the routed experts with no known role: stays in high precision"))
    if len(routers) != 1:
        raise NoExpertPattern(f"{len(routers)} weights of shape [{num_experts}, {hidden}] (a router) sit beside "
                              f"the experts under '{block}'; the generic adapter needs exactly one")
    return routers[0], kept


def _check_config(raw: dict, where: str, layer: int, num_experts: int, width: int, hidden: int) -> int | None:
    """Every config value present must agree with the tensors; returns the layer's top-k (None if absent).
    Values are read as whole numbers through `config_int`, so one of the wrong type is named as such."""
    try:
        values = {k: config_int(raw, k, layer=layer) for k in (*NUM_EXPERTS_KEYS, *EXPERT_WIDTH_KEYS, *TOP_K_KEYS,
                                                                  "hidden_size")}
    except ConfigFieldError as e:
        raise UserError(f"{where} {e}; restore the original config.json.") from None
    width_key = next((k for k in EXPERT_WIDTH_KEYS if values[k] is not None), None)
    expected = [(k, num_experts, "experts") for k in NUM_EXPERTS_KEYS] + [("hidden_size", hidden, "hidden size")]
    expected += [(width_key, width, "expert width")] if width_key else []
    for key, found, what in expected:
        if values[key] is not None and values[key] != found:
            raise UserError(f"{where} has {key} {values[key]}, but the expert tensors of layer {layer} show {what} "
                            f"{found}; the config does not belong to these weights.")
    key = next((k for k in TOP_K_KEYS if values[k] is not None), None)
    top_k = values[key] if key else None
    if top_k is not None and not 1 <= top_k <= num_experts:
        raise UserError(f"{where} has {key} {top_k}, but layer {layer} has {num_experts} experts; "
                        "the config does not belong to these weights.")
    return top_k
