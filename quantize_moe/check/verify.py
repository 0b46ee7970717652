"""`quantize-moe verify`: what CI should know about an FP8 checkpoint before it ships.

Every check reads headers, config and scales only, except the numeric check
against SRC, which walks both checkpoints one layer or tensor at a time. A check
yields one finding: passed (with a summary), or warned / failed with the count
and the first offending tensors or files.

Exit codes: 0 every check passed (warnings allowed); 1 DST or SRC could not be
read at all; 2 the command line was wrong; 3 at least one check failed.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from quantize_moe.quantization import fp8
from quantize_moe.adapters import Kind
from quantize_moe.check.weights import LayerWeightCheck, RoundingError, check_expert_weights, layer_weight_check
from quantize_moe.source.checkpoint import Checkpoint, read_json_object
from quantize_moe.source.locations import INDEX_NAME
from quantize_moe.adapters.reader import SourceReader
from quantize_moe.errors import EXIT_CHECK_FAILED, EXIT_OK, UserError
from quantize_moe.quantization.formats import INPUT_SCALE
from quantize_moe.quantization.ignore_list import ignore_matcher
from quantize_moe.quantization.static import KV_SCALES
from quantize_moe.adapters.fused import scale_name
from quantize_moe.check.findings import Finding, finding
from quantize_moe.check.integrity import IntegrityCheck
from quantize_moe.check.inventory import Inventory, StoredTensor, take_inventory
from quantize_moe.moe.layer import FusedMoE
from quantize_moe.write.destination import PARTIAL_SUFFIX
from quantize_moe.write.pipeline import pick_device
from quantize_moe.plan.plan import scale_siblings

FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class VerifyReport:
    checkpoint: str
    against: str | None
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(f.status != "fail" for f in self.findings)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.ok else EXIT_CHECK_FAILED

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "exit_code": self.exit_code, **asdict(self)}, indent=2)


# -- structure --------------------------------------------------------------------------------------
def _scale_shape_ok(inventory: Inventory, stored: StoredTensor, scale_shape: tuple[int, ...]) -> bool:
    spec, weight_shape = inventory.spec, stored.info.shape
    if stored.role.fused is not None:  # one per-tensor scale per expert (and shard)
        return scale_shape == stored.role.fused.scale_shape(inventory.num_experts[stored.role.layer])
    numel = math.prod(scale_shape)
    if spec.weight == "tensor":
        return numel == 1
    if spec.weight == "channel":
        return numel == weight_shape[0] and scale_shape[0] == weight_shape[0]
    bn, bk = spec.block_shape
    return scale_shape == (math.ceil(weight_shape[0] / bn), math.ceil(weight_shape[1] / bk))


def check_structure(checkpoint: Checkpoint, inventory: Inventory, source: Checkpoint | None) -> Finding:
    """Index, shards and tensors agree; every FP8 weight has a scale of the declared dtype and shape;
    nothing is left over; with SRC, every source tensor is there with its shape."""
    folder, problems = checkpoint.folder, []
    index = folder / INDEX_NAME
    if index.is_file():
        index_data = read_json_object(folder, INDEX_NAME, "restore the index")
        listed = index_data["weight_map"]  # Checkpoint checked it is an object
        problems += [f"tensor '{n}' is in '{i.file}' but not in the index" for n, i in checkpoint.tensors.items()
                     if n not in listed]
        metadata = index_data.get("metadata")
        declared = metadata.get("total_size") if isinstance(metadata, dict) else None
        if metadata is not None and not isinstance(metadata, dict):
            problems.append("the index's metadata is not an object")
        actual = sum(i.nbytes for i in checkpoint.tensors.values())
        if declared is not None and declared != actual:
            problems.append(f"the index declares total_size {declared}, the tensors hold {actual} bytes")
    problems += [f"'{p.name}' is not part of the checkpoint" for p in sorted(folder.glob("*.safetensors"))
                 if p.name not in checkpoint.shard_files]
    problems += [f"'{p.relative_to(folder)}' is a half-written file"
                 for p in sorted(folder.rglob(f"*{PARTIAL_SUFFIX}"))]

    weights_with_scales = set()
    for name, stored in inventory.tensors.items():
        if not stored.quantized:
            continue
        weights_with_scales.add(scale_name(name, INPUT_SCALE))
        scale = inventory.scale_of(name)
        if scale is None:
            problems.append(f"FP8 weight '{name}' has no '{inventory.scale_suffix}'")
            continue
        weights_with_scales.add(scale.name)
        if scale.dtype not in FLOAT_SCALE_DTYPES:
            problems.append(f"scale '{scale.name}' is {scale.dtype}, not a float")
        if not _scale_shape_ok(inventory, stored, scale.shape):
            problems.append(f"scale '{scale.name}' has shape {scale.shape}, which does not fit "
                            f"{inventory.spec.weight} scales of a {stored.info.shape} weight")
    problems += [f"scale '{n}' belongs to no FP8 weight" for n in inventory.scales
                 if n not in weights_with_scales and not n.endswith(KV_SCALES)]  # KV scales: check_metadata

    if source is not None:  # by the names the source's tensors are written as (Llama-4 experts unfused)
        written = {}
        for info in source.tensors.values():
            written.update({name: (shape, info) for name, shape in
                            inventory.family.written_as(info.name, info.shape, inventory.num_experts)})
        for name, (shape, info) in written.items():
            stored = inventory.tensors.get(name)
            if stored is None:
                unfused = "" if name == info.name else f" (its expert Linear '{name}')"
                problems.append(f"source tensor '{info.name}' is missing{unfused}")
            elif stored.info.shape != shape:
                problems.append(f"'{name}' has shape {stored.info.shape}, the source {shape}")
            elif stored.info.dtype not in (info.dtype, fp8.FP8_DTYPE):
                problems.append(f"'{name}' is {stored.info.dtype}, the source {info.dtype}")
        problems += [f"'{n}' is not in the source" for n in inventory.tensors if n not in written]
    summary = (f"{len(checkpoint.tensors)} tensors in {len(checkpoint.shard_files)} shard(s); index, scales "
               f"and {'source ' if source else ''}shapes consistent")
    return finding("structure", problems, summary, "structural problem(s)")


# -- metadata ---------------------------------------------------------------------------------------
def check_metadata(inventory: Inventory) -> Finding:
    """quantization_config agrees with the tensors: FP8 modules are not ignored, every Linear left in
    high precision is (engines would otherwise expect FP8 there), static activations have input scales,
    a declared FP8 KV cache has its k_scale / v_scale."""
    qc = inventory.checkpoint.raw_config.get("quantization_config")
    if qc is None:
        return Finding("metadata", "fail", "config.json has no quantization_config; engines will load the "
                       "checkpoint as unquantized")
    if not isinstance(qc, dict):
        raise UserError(f"'{inventory.checkpoint.folder / 'config.json'}': quantization_config is not an "
                        "object; fix the config.")
    entries, ignored = ignore_matcher(qc, f"'{inventory.checkpoint.folder / 'config.json'}'")
    problems = []
    modules = set()
    for name, stored in inventory.tensors.items():
        if not stored.role.is_linear_weight:
            continue
        module = stored.role.module
        modules.add(module)
        if stored.quantized and ignored(module):
            problems.append(f"'{module}' is FP8 but listed as ignored")
        if not stored.quantized and not ignored(module):
            problems.append(f"'{module}' stays {stored.info.dtype} but is not listed as ignored")
    if inventory.spec.static:
        problems += _static_input_scale_problems(inventory)
    problems += _kv_scale_problems(inventory)
    # An entry may name any module holding tensors (llm-compressor lists model.embed_tokens), not only Linears.
    holders = {name.rsplit(".", 1)[0] for name in inventory.checkpoint.tensors}
    problems += [f"ignore entry '{e}' names no module" for e in entries
                 if not e.startswith("re:") and e not in modules and e not in holders]
    summary = f"{qc.get('quant_method')} config; its {len(entries)} ignore entries are exactly the kept Linears"
    if inventory.kv_cache:
        summary += f"; FP8 KV cache scales for {len(inventory.attention)} attention modules"
    return finding("metadata", problems, summary, "inconsistency(ies) between quantization_config and tensors")


def _static_input_scale_problems(inventory: Inventory) -> list[str]:
    """Static activations: every FP8 weight (Linear, expert or fused expert tensor) has its input scale,
    one value per module (per expert, shaped like the weight scale, for fused expert tensors). Whether
    the values are finite and positive is `check_scales`'s."""
    problems = []
    for name, stored in inventory.tensors.items():
        if not stored.quantized:
            continue
        scale = inventory.scales.get(scale_name(name, INPUT_SCALE))
        if scale is None:
            problems.append(f"'{scale_name(name, INPUT_SCALE)}' is missing, but the config declares static "
                            "activations")
            continue
        weight_scale = inventory.scale_of(name)
        values = math.prod(weight_scale.shape) if stored.role.fused and weight_scale else 1
        if math.prod(scale.shape) != values:
            problems.append(f"'{scale.name}' has shape {scale.shape}; a static input scale is one value per "
                            "module (per expert in a fused expert tensor)")
    return problems


def _kv_scale_problems(inventory: Inventory) -> list[str]:
    """A declared FP8 KV cache: every attention module has its k_scale and v_scale, one value each. KV scales
    without a declared cache, or beside no attention, are reported: an engine would ignore them, or use a
    cache the config does not describe. Whether the values are finite and positive is `check_scales`'s."""
    expected = [f"{module}.{kind}" for module in inventory.attention for kind in KV_SCALES]
    present = {name: info for name, info in inventory.scales.items() if name.endswith(KV_SCALES)}
    problems = []
    if inventory.kv_cache:
        problems += [f"'{name}' is missing, but the config declares an FP8 KV cache (kv_cache_scheme)"
                     for name in expected if name not in present]
    for name, info in present.items():
        if not inventory.kv_cache:
            problems.append(f"'{name}' is a KV-cache scale, but the config declares no kv_cache_scheme")
        elif name not in expected:
            problems.append(f"'{name}' is a KV-cache scale beside no attention module (no k_proj)")
        elif math.prod(info.shape) != 1:
            problems.append(f"'{name}' has shape {info.shape}; a KV-cache scale is one value")
    return problems


# -- scales -----------------------------------------------------------------------------------------
def check_scales(inventory: Inventory) -> Finding:
    problems = []
    for name in inventory.scales:
        scale = inventory.checkpoint.get(name).float()
        if not torch.isfinite(scale).all():
            problems.append(f"'{name}' holds NaN or Inf")
        elif (scale <= 0).any():
            problems.append(f"'{name}' holds a zero or negative scale")
    return finding("scales", problems, f"{len(inventory.scales)} scale tensors finite and positive",
                   "scale tensor(s) not finite and positive")


def check_shared_scales(inventory: Inventory) -> Finding:
    """Per-tensor scales of what engines fuse (gate/up of an expert, q/k/v) must be one value per expert,
    or vLLM requantizes at load (a second rounding): sibling modules share their scale, and the
    per-expert scales of a fused expert tensor (and of its scale group, DBRX w1 with v1) agree."""
    if inventory.spec.weight != "tensor":
        return Finding("shared scales", "skip", f"{inventory.spec.weight} scales: nothing is shared")
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name, stored in inventory.tensors.items():
        role = stored.role
        if not stored.quantized or inventory.scale_of(name) is None:
            continue
        if role.fused is not None:
            groups[(f"layer {role.layer} {role.fused.scale_group}", role.layer)].append(name)
            continue
        if (siblings := scale_siblings(role)) is not None:
            groups[(f"{role.module.rpartition('.')[0]}.{{{','.join(sorted(siblings))}}}", None)].append(name)
    problems = []
    for (where, layer), names in groups.items():
        experts = inventory.num_experts.get(layer, 1)
        scales = torch.cat([inventory.checkpoint.get(inventory.scale_of(n).name).float().reshape(experts, -1)
                            for n in names], dim=1)
        if not torch.equal(scales, scales[:, :1].expand_as(scales)):
            problems.append(f"'{where}' has different scales")
    return finding("shared scales", problems, f"{len(groups)} fused groups share one scale each",
                   "fused group(s) with different scales (vLLM requantizes them at load)")


# -- coverage ---------------------------------------------------------------------------------------
def check_coverage(inventory: Inventory) -> Finding:
    """Every expert of every MoE layer is FP8; nothing that must stay high precision is."""
    experts: dict[tuple, StoredTensor] = {}
    for s in inventory.tensors.values():
        role = s.role
        if role.kind != Kind.ROUTED_EXPERT:
            continue
        if role.fused is None:
            experts[(role.layer, role.expert, role.shard_id)] = s
        else:
            experts.update({(role.layer, e, shard): s for e in range(inventory.num_experts.get(role.layer, 0))
                            for shard in role.fused.shards})
    problems, total = [], 0
    for layer, num_experts in inventory.num_experts.items():
        for expert in range(num_experts):
            for shard_id in ("w1", "w3", "w2"):
                total += 1
                stored = experts.get((layer, expert, shard_id))
                if stored is None:
                    problems.append(f"layer {layer} expert {expert} {shard_id} is missing")
                elif not stored.quantized:
                    problems.append(f"'{stored.info.name}' ({shard_id} of expert {expert}) is {stored.info.dtype}, "
                                    "not FP8")
    problems += [f"'{name}' is FP8 but must stay high precision ({s.role.reason})"
                 for name, s in inventory.tensors.items()
                 if s.quantized and s.role.kind in (Kind.ROUTER, Kind.HIGH_PRECISION)]
    return finding("coverage", problems, f"all {total} routed expert projections FP8; routers, embeddings, "
                   "norms and lm_head kept", "coverage problem(s)")


# -- numerics ---------------------------------------------------------------------------------------
def check_numerics(inventory: Inventory, source: Checkpoint) -> list[Finding]:
    """Routed experts through the stacked FusedMoE view; every other FP8 weight dequantized within FP8
    rounding of the source; every kept tensor bit-identical to the source; on a GPU, every MoE layer run
    through the FP8 Triton kernels against bf16 (`validate`), whose loaded layers the expert check reads,
    so each layer's experts are read once. On a CPU that run takes long enough to be its own command."""
    device = pick_device("auto")
    if device.type == "cuda":
        layers: list[LayerWeightCheck] = []
        outputs = check_layer_outputs(inventory, source, lambda layer, original, quantized: layers.append(
            layer_weight_check(layer, original, quantized)))
    else:
        layers = check_expert_weights(source.folder, inventory.checkpoint.folder, inventory.adapter, str(device))
        outputs = Finding("numerics: layer outputs", "skip", "no CUDA GPU; run `quantize-moe validate SRC DST` "
                          "to compare layer outputs on the CPU")
    experts = finding("numerics: experts",
                      [f"layer {c.layer}: worst error {c.worst_bound_ratio:.2f}x the FP8 rounding bound"
                       for c in layers if not c.ok],
                      f"{len(layers)} MoE layers within FP8 rounding (worst "
                      f"{max((c.worst_bound_ratio for c in layers), default=0):.2f} of the bound)",
                      "MoE layer(s) outside FP8 rounding of the source")
    problems, compared = [], 0
    reader = SourceReader(inventory.checkpoint, torch.float32, inventory.adapter)
    error = RoundingError(device)  # in row blocks through buffers reused by every tensor: none is copied whole
    for name, stored in inventory.tensors.items():
        if stored.role.kind == Kind.ROUTED_EXPERT or name not in source.tensors:
            continue
        original, compared = source.get(name), compared + 1
        if not stored.quantized:
            if not torch.equal(original, inventory.checkpoint.get(name)):
                problems.append(f"kept tensor '{name}' differs from the source")
            continue
        error.reset()
        error.add(original, inventory.checkpoint.get(name), reader.stored_scale(name), reader.spec)
        ratio = error.result()[1]
        if ratio > 1.0:
            problems.append(f"'{name}': worst error {ratio:.2f}x the FP8 rounding bound")
    others = finding("numerics: other tensors", problems, f"{compared} other tensors match the source (kept "
                     "ones bit for bit, FP8 ones within rounding)", "tensor(s) differ from the source")
    return [experts, others, outputs]


def check_layer_outputs(inventory: Inventory, source: Checkpoint,
                        on_loaded: Callable[[int, FusedMoE, FusedMoE], None]) -> Finding:
    """Every MoE layer of DST run through the FP8 Triton kernels against SRC's bf16 experts (`validate`)."""
    from quantize_moe.check.validate import validate

    report = validate(source.folder, inventory.checkpoint.folder, device="cuda", adapter=inventory.adapter,
                      on_loaded=on_loaded)
    return finding("numerics: layer outputs",
                   [f"layer {r.layer}: relative error {r.relative_error:.1e}, cosine {r.cosine:.4f}"
                     for r in report.layers if not r.passed],
                   f"{len(report.layers)} MoE layers' FP8 outputs on {report.device} within the validate "
                   "thresholds", "MoE layer(s) fail validate's thresholds")


def verify(folder: str | Path, source: Checkpoint | None = None, adapter: str | None = None,
           integrity: IntegrityCheck | None = None) -> VerifyReport:
    """Run every check on the checkpoint in `folder`; `source` adds the checks against SRC; `adapter`
    ("generic") reads both through the generic adapter; `integrity` is the integrity check the caller
    started on `folder` before importing this module (otherwise it starts here, first)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"DST '{folder}' does not exist or is not a folder; point verify at a quantized "
                        "checkpoint folder.")
    if integrity is None:
        with IntegrityCheck(folder) as integrity:
            return _run_checks(folder, source, adapter, integrity)
    return _run_checks(folder, source, adapter, integrity)


def _run_checks(folder: Path, source: Checkpoint | None, adapter: str | None,
                integrity: IntegrityCheck) -> VerifyReport:
    report = VerifyReport(str(folder), str(source.folder) if source else None)
    try:
        checkpoint = Checkpoint(folder)
    except UserError as e:
        report.findings.append(Finding("structure", "fail", str(e)))
        return report
    try:
        inventory = take_inventory(checkpoint, adapter)
    except UserError as e:
        report.findings.append(Finding("metadata", "fail", str(e)))
        return report
    report.findings += [check_structure(checkpoint, inventory, source), check_metadata(inventory),
                        check_scales(inventory), check_shared_scales(inventory), check_coverage(inventory),
                        integrity.finding(checkpoint)]
    if source is None:
        report.findings.append(Finding("numerics", "skip", "pass --against SRC to compare with the source"))
    elif report.ok:
        report.findings += check_numerics(inventory, source)
    else:
        report.findings.append(Finding("numerics", "skip", "skipped: fix the failures above first"))
    checkpoint.close()
    return report
