"""The plan of a run, made from metadata alone before any tensor data is read.

It decides, for every tensor, whether it is quantized or kept (and why), groups
tensors that must share a scale, and assigns the output tensors to shards, so
that sizes, names and the whole output layout are known up front.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
from transformers import PretrainedConfig

from quantize_moe.adapters import Kind, MoELayerInfo, PerExpertFamily, TensorRole
from quantize_moe.adapters.fused import FusedLayout, scale_name
from quantize_moe.source.checkpoint import Checkpoint, TensorInfo
from quantize_moe.source.locations import CONFIG_NAME
from quantize_moe.adapters.reader import SourceReader
from quantize_moe.plan.compatibility import resolve_options
from quantize_moe.plan.options import Options
from quantize_moe.errors import UserError
from quantize_moe.quantization.formats import FORMATS, INPUT_SCALE, read_quantization
from quantize_moe.quantization.fp8 import FP8_DTYPE
from quantize_moe.quantization.schemes import SCHEMES
from quantize_moe.plan.calibrated import check_calibrated_outputs, kv_cache_modules
from quantize_moe.quantization.static import KV_SCALES

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Sibling Linears that engines fuse into one module (and requantize to one scale at load):
# quantizing them with one shared scale keeps that load step exact.
FUSED_SIBLINGS = (
    frozenset({"w1", "w3"}),
    frozenset({"gate_proj", "up_proj"}),
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"q_a_proj", "kv_a_proj_with_mqa"}),
)
GATE_UP = FUSED_SIBLINGS[0]


def scale_siblings(role: TensorRole) -> frozenset[str] | None:
    """The siblings sharing this Linear's scale: gate and up of a routed expert by shard id, whatever
    the projections are called (the generic adapter meets any names), else fused Linears by name."""
    if role.kind == Kind.ROUTED_EXPERT and role.shard_id in GATE_UP:
        return GATE_UP
    leaf = role.module.rpartition(".")[2]
    return next((s for s in FUSED_SIBLINGS if leaf in s), None)


@dataclass(frozen=True)
class Decision:
    info: TensorInfo
    role: TensorRole
    quantize: bool
    reason: str = ""  # why it is kept, when it is


@dataclass(frozen=True)
class OutputTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return TensorInfo(self.name, "", self.dtype, self.shape).nbytes


@dataclass(frozen=True)
class WorkItem:
    """Source tensors processed together; quantized items share one scale group."""

    sources: tuple[str, ...]
    quantize: bool
    outputs: tuple[OutputTensor, ...]
    input_bytes: int


@dataclass
class Plan:
    source: SourceReader  # the checkpoint, read in high precision (pre-quantized SRCs dequantized)
    family: PerExpertFamily
    config: PretrainedConfig
    options: Options
    moe_layers: list[MoELayerInfo]
    decisions: dict[str, Decision]
    items: list[WorkItem]
    shards: list[list[WorkItem]] = field(default_factory=list)
    # Calibrated outputs are items without sources (plan/calibrated.py); their values, by output name.
    calibrated_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def checkpoint(self) -> Checkpoint:
        return self.source.checkpoint

    @property
    def scheme(self):
        return SCHEMES[self.options.scheme]

    @property
    def format(self):
        return FORMATS[self.options.format]

    @property
    def ignored_modules(self) -> list[str]:
        """Every Linear left in high precision, by exact module name; for routed experts kept in
        high precision (multi-token-prediction layers) also their `experts` module, the name an
        engine's FusedMoE layer is looked up by."""
        kept = [d.role for d in self.decisions.values() if d.role.is_linear_weight and not d.quantize]
        experts = {r.module.rpartition(".experts.")[0] + ".experts" for r in kept
                   if r.kind == Kind.ROUTED_EXPERT and ".experts." in r.module}
        return sorted({r.module for r in kept} | experts)

    @property
    def written_experts(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every routed expert weight as written (Llama-4's fused tensors per expert)."""
        num_experts = {info.layer: info.num_experts for info in self.moe_layers}
        return [w for name, d in self.decisions.items() if d.role.kind == Kind.ROUTED_EXPERT
                for w in self.family.written_as(name, d.info.shape, num_experts)]

    @property
    def fused_family(self) -> str | None:
        """The family's name when experts are written as fused tensors (engines take per-tensor scales only)."""
        fused = any(d.role.fused is not None and not d.role.fused.unfused for d in self.decisions.values())
        return self.family.name if fused else None

    def moe_layer(self, layer: int) -> MoELayerInfo:
        return next(info for info in self.moe_layers if info.layer == layer)

    @property
    def mtp_layers(self) -> list[int]:
        """Multi-token-prediction layers present on disk (kept in high precision)."""
        return sorted({self.family.layer_of(name) for name, d in self.decisions.items()
                       if d.reason == MTP_REASON})

    @property
    def quantization_config(self) -> dict:
        quantized = sorted({d.role.module for d in self.decisions.values() if d.quantize})
        return self.format.quantization_config(self.scheme, self.ignored_modules, quantized, self.options.activations,
                                               self.options.kv_cache is not None)

    @property
    def bytes_before(self) -> int:
        """On disk, scales of a pre-quantized SRC included."""
        return sum(info.nbytes for info in self.checkpoint.tensors.values())

    @property
    def bytes_after(self) -> int:
        return sum(o.nbytes for item in self.items for o in item.outputs)

    def check_loadable(self) -> None:
        """Refuse, before anything is written, an output that no engine loads."""
        family, where = self.family, f"'{self.checkpoint.folder / CONFIG_NAME}'"
        quantizes_experts = any(d.quantize and d.role.kind == Kind.ROUTED_EXPERT for d in self.decisions.values())
        if family.fp8_refusal and quantizes_experts:
            raise UserError(f"{where} is a {family.name} checkpoint, which quantize-moe does not quantize: "
                            f"{family.fp8_refusal}.")

    def check_requantize(self) -> None:
        """A pre-quantized SRC is requantized only when asked for: every weight is then rounded to FP8
        twice, and `verify --against` the bf16 original finds errors beyond one rounding. Checked by
        `quantize`, not by `make_plan`, so that `inspect` still describes such a SRC."""
        where = f"'{self.checkpoint.folder / CONFIG_NAME}'"
        _check_source_not_done(self.checkpoint.raw_config, self.options, where)
        if self.source.quantized and not self.options.requantize:
            method = self.checkpoint.raw_config["quantization_config"].get("quant_method")
            raise UserError(f"{where} says the checkpoint is already quantized ({method}); quantizing it again "
                            "rounds every weight twice, so point SRC at the bf16/fp16/fp32 original, or pass "
                            "--requantize to do it anyway (the model card says so).")

    @property
    def shard_names(self) -> list[str]:
        n = len(self.shards)
        if n == 1:
            return ["model.safetensors"]
        return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


MTP_REASON = "multi-token-prediction layer: kept in high precision"


def _kv_items(modules: list[str]) -> list[WorkItem]:
    """One item per attention module with its k_scale and v_scale (float32 scalars, vLLM's names)."""
    return [WorkItem((), False, tuple(OutputTensor(f"{m}.{k}", torch.float32, ()) for k in KV_SCALES), 0) for m in modules]


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def make_plan(checkpoint: Checkpoint, options: Options = Options()) -> Plan:
    where = f"'{checkpoint.folder / CONFIG_NAME}'"
    source = SourceReader(checkpoint, dtype=torch.float32, adapter=options.adapter)
    family = source.family
    config = source.config  # parsed once, by the reader
    roles = {name: family.role(name, len(checkpoint.tensors[name].shape)) for name in source.names}
    moe_layers = family.moe_layers(config)
    num_experts = {info.layer: info.num_experts for info in moe_layers}
    shapes = {name: [shape for _, shape in family.written_as(name, checkpoint.tensors[name].shape, num_experts)]
              for name in source.names}
    stay_fused = any(r.fused is not None and not r.fused.unfused for r in roles.values())
    options = resolve_options(options, [(name, shape) for name in source.names
                                        if roles[name].kind == Kind.ROUTED_EXPERT for shape in shapes[name]],
                              fused_family=family.name if stay_fused else None, family=family.name)
    check_calibrated_outputs(options, family, config, where)
    mtp = set(family.mtp_layers(config))
    decisions = {}
    for name in source.names:
        info = replace(checkpoint.tensors[name], dtype=source.output_dtype(name))
        kept = family.kept_in(name, options.format, options.scheme)
        decisions[name] = Decision(info, roles[name], False, kept) if kept else \
            _decide(info, roles[name], options, shapes[name], in_mtp_layer=family.layer_of(name) in mtp)
    _keep_fused_siblings_together(decisions)
    _check_experts(family, moe_layers, decisions, where)
    items = _work_items(decisions, options, num_experts) + (
        _kv_items(kv_cache_modules(family, config, source.names, where)) if options.kv_cache else [])
    plan = Plan(source, family, config, options, moe_layers, decisions, items)
    _check_output_names(plan.items, checkpoint)
    plan.shards = _assign_shards(plan.items, options.max_shard_size)
    return plan


def _check_source_not_done(raw: dict, options: Options, where: str) -> None:
    """Refuse a SRC already quantized as asked (format, scheme, activations, KV cache): nothing to do."""
    qc = raw.get("quantization_config") or {}  # none: its quant_method None is no format's
    scheme, fmt, kv_cache = SCHEMES[options.scheme], FORMATS[options.format], options.kv_cache == "fp8"
    asked = {"quantization_config": fmt.quantization_config(scheme, [], [], options.activations, kv_cache)}  # ours
    declared = (qc.get("quant_method"), *read_quantization(raw, where), qc.get("kv_cache_scheme") is not None)
    if declared == (fmt.name, *read_quantization(asked, where), kv_cache):
        raise UserError(f"{where} says the checkpoint is already quantized ({declared[0]}) as --scheme "
                        f"{options.scheme} --format {options.format}{' --activations static' * declared[1].static}"
                        f"{' --kv-cache fp8' * kv_cache} asks, so there is nothing to do; point SRC at the "
                        "bf16/fp16/fp32 original, or ask for another --scheme or --format with --requantize.")


def _decide(info: TensorInfo, role: TensorRole, options: Options, shapes: list[tuple[int, ...]],
            in_mtp_layer: bool = False) -> Decision:
    if role.kind in (Kind.ROUTER, Kind.HIGH_PRECISION):
        return Decision(info, role, False, role.reason)
    if in_mtp_layer:
        return Decision(info, role, False, MTP_REASON)
    if role.kind == Kind.LINEAR and options.experts_only:
        return Decision(info, role, False, "--experts-only")
    if info.dtype == FP8_DTYPE or info.dtype not in FLOAT_DTYPES:
        raise UserError(f"Tensor '{info.name}' in '{info.file}' is {info.dtype}, not bf16/fp16/fp32; "
                        "quantize-moe needs an unquantized checkpoint as SRC.")
    # Routed experts that misfit were refused when the scheme was chosen; other Linears stay.
    if misfit := next(filter(None, map(SCHEMES[options.scheme].misfit, shapes)), None):
        return Decision(info, role, False, f"--scheme {options.scheme}: {misfit}")
    return Decision(info, role, True)


def _sibling_group(role: TensorRole) -> tuple | None:
    siblings = scale_siblings(role)
    return None if siblings is None else (role.module.rpartition(".")[0], siblings)


def _keep_fused_siblings_together(decisions: dict[str, Decision]) -> None:
    """Engines fuse sibling Linears (q/k/v, gate/up) into one module that is quantized whole or not at
    all, so when one sibling stays in high precision its siblings stay with it."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name, d in decisions.items():
        if d.role.is_linear_weight and (key := _sibling_group(d.role)):
            groups[key].append(name)
    for names in groups.values():
        kept = next((decisions[n] for n in names if not decisions[n].quantize), None)
        if kept is None:
            continue
        for n in names:
            if decisions[n].quantize:
                sibling = kept.role.module.rpartition(".")[2]
                decisions[n] = replace(decisions[n], quantize=False,
                                       reason=f"fused with {sibling}, which stays: {kept.reason}")


def _group_key(name: str, decision: Decision) -> tuple:
    """Tensors that share one scale: gate/up/q/k/v siblings of a module, or the fused expert
    tensors of one layer's scale group (DBRX w1 with v1)."""
    role = decision.role
    if decision.quantize and role.fused is not None:
        return ("fused", role.layer, role.fused.scale_group)
    return (decision.quantize and _sibling_group(role)) or (name,)


def _work_items(decisions: dict[str, Decision], options: Options, num_experts: dict[int, int]) -> list[WorkItem]:
    scheme, fmt = SCHEMES[options.scheme], FORMATS[options.format]
    groups: dict[tuple, list[str]] = {}
    for name in sorted(decisions, key=_natural_key):
        groups.setdefault(_group_key(name, decisions[name]), []).append(name)

    items = []
    for names in groups.values():
        infos = [decisions[n].info for n in names]
        _check_group_dtypes(infos)
        if decisions[names[0]].quantize:
            roles = [decisions[n].role for n in names]
            outputs = [o for info, role in zip(infos, roles)
                       for o in _quantized_outputs(info, role.fused, num_experts.get(role.layer), scheme, fmt)]
        else:
            outputs = [OutputTensor(i.name, i.dtype, i.shape) for i in infos]
        items.append(WorkItem(tuple(names), decisions[names[0]].quantize, tuple(outputs),
                              sum(i.nbytes for i in infos)))
        if options.activations == "static" and decisions[names[0]].quantize:
            items.append(WorkItem((), False, tuple(
                OutputTensor(f"{decisions[i.name].role.module}.{INPUT_SCALE}", fmt.scale_dtype(i.dtype),
                             fmt.scale_shape(scheme, i.shape)) for i in infos), 0))
    return items


def _quantized_outputs(info: TensorInfo, layout: FusedLayout | None, experts: int | None, scheme,
                       fmt) -> list[OutputTensor]:
    """The FP8 weights a quantized tensor is written as, each followed by its scale: itself, every expert
    of an unfused layout, or a fused tensor with one per-tensor scale per expert."""
    if layout is not None and not layout.unfused:
        return [OutputTensor(info.name, FP8_DTYPE, info.shape),
                OutputTensor(scale_name(info.name, fmt.scale_suffix(scheme)), fmt.scale_dtype(info.dtype),
                             layout.scale_shape(experts))]
    weights = layout.expert_weights(info.name, experts, info.shape) if layout else [(info.name, info.shape)]
    return [out for name, shape in weights
            for out in (OutputTensor(name, FP8_DTYPE, shape),
                        OutputTensor(f"{name.removesuffix('.weight')}.{fmt.scale_suffix(scheme)}",
                                     fmt.scale_dtype(info.dtype), fmt.scale_shape(scheme, shape)))]


def _check_output_names(items: list[WorkItem], checkpoint: Checkpoint) -> None:
    """Every output tensor has its own name. A kept SRC tensor named like a scale this run writes (a
    leftover `weight_scale` in a bf16 checkpoint) would otherwise be written twice into one shard."""
    owner: dict[str, WorkItem] = {}
    for item in items:
        for output in item.outputs:
            if output.name in owner:
                kept = output.name if output.name in checkpoint.tensors else owner[output.name].sources[0]
                weight = next((s.sources for s in (owner[output.name], item) if s.quantize),  # or a calibrated
                              (f"{output.name.rpartition('.')[0]}.weight",))  # input scale of this module
                raise UserError(f"SRC tensor '{kept}' has the name of the scale this run writes for "
                                f"'{weight[0]}', but SRC is not quantized there; it is a leftover of another "
                                "tool: remove it from SRC (or restore the quantization_config it belongs to).")
            owner[output.name] = item


def _check_group_dtypes(infos: list[TensorInfo]) -> None:
    """Tensors that share a scale must share a dtype. A model may mix dtypes (an fp32 router
    beside bf16 experts is normal, and kept tensors keep theirs), but gate and up of one expert
    in different dtypes means shards from different saves were put together."""
    odd = next((i for i in infos if i.dtype != infos[0].dtype), None)
    if odd is not None:
        raise UserError(f"Tensor '{odd.name}' in '{odd.file}' is {odd.dtype} but '{infos[0].name}', which shares "
                        f"its scale, is {infos[0].dtype}; the shards come from different saves, so restore "
                        "a consistent checkpoint.")


def _assign_shards(items: list[WorkItem], max_shard_size: int) -> list[list[WorkItem]]:
    """Greedy split like `save_pretrained`: start a new shard when the next item would overflow."""
    shards: list[list[WorkItem]] = [[]]
    size = 0
    for item in items:
        item_bytes = sum(o.nbytes for o in item.outputs)
        if shards[-1] and size + item_bytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item_bytes
    return shards


def _check_experts(family: PerExpertFamily, moe_layers: list[MoELayerInfo], decisions: dict[str, Decision],
                   where: str) -> None:
    """Every expert of every MoE layer the config declares is on disk with consistent shapes."""
    per_expert: dict[int, dict[tuple[int, str], tuple[int, ...]]] = defaultdict(dict)
    fused: dict[int, dict] = defaultdict(dict)
    for d in decisions.values():
        if d.role.kind != Kind.ROUTED_EXPERT or d.reason == MTP_REASON:
            continue
        if d.role.fused is None:
            per_expert[d.role.layer][(d.role.expert, d.role.shard_id)] = d.info.shape
        else:
            fused[d.role.layer][d.role.fused] = d.info
    declared = {info.layer: info for info in moe_layers}
    undeclared = sorted((set(per_expert) | set(fused)) - set(declared))
    if undeclared:
        raise UserError(f"Layer {undeclared[0]} has routed experts on disk but {where} does not make it an "
                        "MoE layer; the config does not belong to these weights.")
    for layer, info in declared.items():
        if family.fused and not per_expert.get(layer):  # a family with both layouts (Llama-4) may hold either
            _check_fused_layer(family, info, fused.get(layer, {}), where)
        else:
            _check_per_expert_layer(info, per_expert.get(layer, {}), where)


def _check_fused_layer(family: PerExpertFamily, info: MoELayerInfo, on_disk: dict, where: str) -> None:
    for layout in family.fused:
        want = layout.disk_shape(info.num_experts, info.hidden_size, info.expert_width)
        found = on_disk.get(layout)
        if found is None:
            raise UserError(f"Layer {info.layer} has no fused expert tensor matching '{layout.name}', but "
                            f"{where} makes it an MoE layer; the checkpoint is incomplete.")
        if found.shape != want:
            raise UserError(f"Tensor '{found.name}' has shape {found.shape}, but {where} implies {want} "
                            f"({info.num_experts} experts); the config does not match the weights.")


def _check_per_expert_layer(info: MoELayerInfo, on_disk: dict[tuple[int, str], tuple[int, ...]],
                            where: str) -> None:
    layer = info.layer
    experts = {e for e, _ in on_disk}
    if len(experts) != info.num_experts or experts != set(range(info.num_experts)):
        raise UserError(f"{where} declares {info.num_experts} experts in layer {layer}, but the "
                        f"checkpoint holds {len(experts)}; the config does not match the weights.")
    want = {"w1": (info.expert_width, info.hidden_size), "w3": (info.expert_width, info.hidden_size),
            "w2": (info.hidden_size, info.expert_width)}
    for expert in range(info.num_experts):
        for shard_id in ("w1", "w3", "w2"):
            shape = on_disk.get((expert, shard_id))
            if shape != want[shard_id]:
                raise UserError(f"Expert {expert} of layer {layer} has a {shard_id} weight of shape "
                                f"{shape}, but {where} implies {want[shard_id]}; the config does not "
                                "match the weights.")
