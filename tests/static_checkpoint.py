"""Static-activation checkpoints for the tests that read them (verify, validate, evaluate, the MoE layer).

`make_static` turns a per-tensor FP8 output of `quantize` into what llm-compressor's static FP8 preset
writes: an `input_scale` beside every FP8 weight (native fp8: float32 shape (); compressed-tensors: shape
(1,) in the weight scale's dtype) and a config declaring static activations. The scales come from
`measured_input_scales`, hooks on transformers' own forward of SRC (amax of each input / 448), so they
are independent of the code under test.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from quantize_moe.adapters import Kind
from quantize_moe.check.inventory import take_inventory
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.write.destination import MANIFEST_NAME

FP8_MAX = 448.0


def measured_input_scales(src: Path, batches: list[torch.Tensor]) -> dict:
    """amax / 448 of what each Linear (by module name) and each routed expert ((layer, expert, "w13" or
    "w2")) sees over `batches`, and each MoE layer's largest ((layer, "w13"/"w2")) for experts that got
    no token."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    amax: dict = defaultdict(float)

    def linear_hook(name):
        return lambda module, args: amax.__setitem__(name, max(amax[name], args[0].abs().max().item()))

    def experts_hook(layer):
        def hook(module, args):
            hidden, ids = args[0], args[1]
            for e in ids.unique().tolist():
                x = hidden[(ids == e).any(-1)].float()
                gate, up = F.linear(x, module.gate_up_proj[e].float()).chunk(2, dim=-1)
                for key, value in (("w13", x), ("w2", F.silu(gate) * up)):
                    for where in ((layer, e, key), (layer, key)):
                        amax[where] = max(amax[where], value.abs().max().item())
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(linear_hook(name))
        elif hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            module.register_forward_pre_hook(experts_hook(int(name.split(".layers.")[1].split(".")[0])))
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch)
    return {key: value / FP8_MAX for key, value in amax.items()}


def static_scales(dst: Path, measured: dict) -> dict[str, float]:
    """The input scale of every FP8 weight's module of DST, from `measured_input_scales` of its SRC."""
    inventory = take_inventory(Checkpoint(dst))
    scales = {}
    for name, stored in inventory.tensors.items():
        if not stored.quantized:
            continue
        role, module = stored.role, name.removesuffix(".weight")
        if role.kind == Kind.ROUTED_EXPERT:
            key = "w2" if role.shard_id == "w2" else "w13"
            scales[module] = measured.get((role.layer, role.expert, key), measured[(role.layer, key)])
        else:
            scales[module] = measured[module]
    return scales


def edit_shards(folder: Path, edit, shards: list[str] | None = None) -> None:
    """Rewrite each shard of `folder` (or only `shards`) after `edit(tensors)`, keeping the index's weight
    map and total size consistent with what the edits added or removed."""
    folder = Path(folder)
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else None
    for shard in shards or (sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]):
        tensors = load_file(folder / shard)
        edit(tensors)
        save_file(tensors, folder / shard, metadata={"format": "pt"})
        if index:
            index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard} | \
                dict.fromkeys(tensors, shard)
    if index:
        index_file.write_text(json.dumps(index, indent=2))
        index["metadata"]["total_size"] = sum(i.nbytes for i in Checkpoint(folder).tensors.values())
        index_file.write_text(json.dumps(index, indent=2))


def make_static(dst: Path, scales: dict[str, float]) -> None:
    """Write `<module>.input_scale` for every module in `scales` into the shard holding its weight,
    declare static activations, and drop the manifest (the shards changed, as a foreign tool's would)."""
    dst = Path(dst)
    config = json.loads((dst / "config.json").read_text())
    qc = config["quantization_config"]
    native = qc["quant_method"] == "fp8"

    def add_scales(tensors):
        for module in scales:
            if f"{module}.weight" in tensors:
                dtype = torch.float32 if native else tensors[f"{module}.weight_scale"].dtype
                value = torch.tensor(scales[module], dtype=torch.float32)
                tensors[f"{module}.input_scale"] = (value if native else value.reshape(1)).to(dtype)

    edit_shards(dst, add_scales)
    if native:
        qc["activation_scheme"] = "static"
    else:
        qc["config_groups"]["group_0"]["input_activations"] = {
            "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor",
            "group_size": None}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / MANIFEST_NAME).unlink(missing_ok=True)
