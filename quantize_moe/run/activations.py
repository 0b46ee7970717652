"""The activations of an FP8 checkpoint quantized as it declares, inside the layer-streamed model.

`SourceReader` dequantizes FP8 weights, but an engine also rounds the input of every FP8 GEMM to FP8:
dynamically (per token, per tensor or per 128-column group) or with the checkpoint's static
`input_scale`. Without that rounding `evaluate` would measure the weights alone, and a checkpoint whose
static scales are wrong would look as good as a right one. While a decoder layer runs,
`activations_as_declared` fake-quantizes the input of each Linear whose weight is FP8 in the checkpoint
(a forward pre-hook) and runs the family's experts module through the fused-MoE torch reference, whose
activations are quantized like the kernels' (static: one scale per layer and GEMM, the max over experts,
as vLLM loads them). A declared FP8 KV cache rounds the keys and values each attention module caches
through FP8 with its `k_scale` / `v_scale` (run/attention.py reaches them where vLLM stores them).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext

import torch

from quantize_moe.adapters import Kind
from quantize_moe.adapters.fused import scale_name
from quantize_moe.adapters.reader import SourceReader
from quantize_moe.errors import UserError
from quantize_moe.moe.methods import layer_input_scale
from quantize_moe.moe.reference import fake_quantize, fused_experts_reference
from quantize_moe.quantization.formats import INPUT_SCALE, reads_kv_cache
from quantize_moe.quantization.fp8 import FP8_DTYPE
from quantize_moe.quantization.spec import MoEQuantSpec
from quantize_moe.quantization.static import KV_SCALES
from quantize_moe.run.attention import attention_through

KV_FP8 = "quantize-moe-kv-fp8"
PER_TENSOR = MoEQuantSpec("tensor", "static")  # a k_scale / v_scale: one static scale per tensor


def _input_scale(reader: SourceReader, weights: list[str]) -> torch.Tensor | None:
    """The static input scale of these FP8 weights (the max of theirs), None for dynamic activations."""
    if not reader.spec.static:
        return None
    names = [scale_name(name, INPUT_SCALE) for name in weights]
    missing = [name for name in names if name not in reader.checkpoint.tensors]
    if missing:
        raise UserError(f"'{reader.checkpoint.folder}' declares static activations but has no '{missing[0]}'; "
                        "recalibrate the checkpoint.")
    scales = [reader.checkpoint.get(name).float().flatten() for name in names]
    return layer_input_scale(torch.cat(scales), [f"'{name}'" for name, scale in zip(names, scales) for _ in scale])


def _linear_hook(reader: SourceReader, scale: torch.Tensor | None):
    def hook(module, args):
        x = args[0]
        return (fake_quantize(x.reshape(-1, x.shape[-1]), reader.spec, scale).reshape(x.shape), *args[1:])
    return hook


def _experts_forward(module: torch.nn.Module, reader: SourceReader, a13: torch.Tensor | None,
                     a2: torch.Tensor | None):
    """transformers' experts call `(hidden_states [T, H], top_k_index, top_k_weights)`, or Llama-4's
    `(hidden_states [E * T, H])` (every expert on its own block of rows, the router weight already in them),
    computed by the reference with FP8-rounded activations; weights are the dequantized ones already in
    the module. A Llama-4 expert's rows of tokens not routed to it are zero, so they change neither its
    output nor a dynamic per-tensor scale."""
    def forward(hidden_states, top_k_index=None, top_k_weights=None):
        w13, w2 = module.gate_up_proj, module.down_proj
        if getattr(module, "is_transposed", top_k_index is None):  # stored [E, H, 2I] / [E, I, H]; Llama-4's bmm
            w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        if top_k_index is None:
            rows = hidden_states.shape[0] // w13.shape[0]
            top_k_index = torch.arange(w13.shape[0], device=hidden_states.device).repeat_interleave(rows)[:, None]
            top_k_weights = torch.ones(top_k_index.shape, dtype=hidden_states.dtype, device=hidden_states.device)
        return fused_experts_reference(hidden_states, w13, w2, top_k_weights, top_k_index, quant=reader.spec,
                                       a13_scale=a13, a2_scale=a2,
                                       weights_dequantized=True).to(hidden_states.dtype)
    return forward


def _rows_per_expert(module: torch.nn.Module) -> bool:
    """transformers' Llama-4 experts: `forward(hidden_states)` of every expert's block of rows, gate and up
    concatenated in `gate_up_proj` [E, H, 2I] (bmm), no biases."""
    return list(inspect.signature(module.forward).parameters) == ["hidden_states"] and not any(
        "bias" in name for name, _ in module.named_parameters())


def plain_gated_experts(module: torch.nn.Module) -> bool:
    """transformers' experts module in the layout the torch reference runs: gate and up concatenated in
    `gate_up_proj`, no biases, no norm after the experts (calibration measures the same layout)."""
    return (not getattr(module, "has_bias", True) and getattr(module, "has_gate", False)
            and getattr(module, "is_concatenated", False) and not getattr(module, "has_post_expert_norm", False))


def _experts_module(layer: torch.nn.Module, where: str) -> torch.nn.Module:
    candidates = [m for m in layer.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]
    if len(candidates) != 1 or not (plain_gated_experts(candidates[0]) or _rows_per_expert(candidates[0])):
        raise UserError(f"{where}: the FP8 experts are not in one gated, bias-free experts module of "
                        "transformers, so their activations cannot be quantized as an engine does; evaluate "
                        "cannot run this family's FP8 checkpoint.")
    return candidates[0]


def _kv_cache_as_declared(reader: SourceReader, layer: torch.nn.Module, prefix: str, config):
    """When the checkpoint declares an FP8 KV cache, the keys and values of every attention module of the
    layer rounded through FP8 with its `k_scale` / `v_scale` while the layer runs; an attention module
    without them is one sentence, never a bf16 cache in silence."""
    if not reads_kv_cache(reader.checkpoint.raw_config, f"'{reader.checkpoint.folder / 'config.json'}'"):
        return nullcontext()
    names, scales = {id(module): name for name, module in layer.named_modules()}, {}

    def rounded(module, key, value):
        if id(module) not in scales:
            wanted = [f"{prefix}{names[id(module)]}.{kind}" for kind in KV_SCALES]
            missing = [name for name in wanted if name not in reader.checkpoint.tensors]
            if missing:
                raise UserError(f"'{reader.checkpoint.folder}' declares an FP8 KV cache but has no '{missing[0]}'; "
                                "recalibrate the checkpoint with --kv-cache fp8.")
            scales[id(module)] = [layer_input_scale(reader.checkpoint.get(name), [f"'{name}'"]) for name in wanted]
        return tuple(fake_quantize(x.reshape(-1, x.shape[-1]), PER_TENSOR, scale).reshape(x.shape)
                     for x, scale in zip((key, value), scales[id(module)]))

    return attention_through(config, KV_FP8, rounded, "evaluate cannot run this checkpoint's FP8 KV cache")


@contextmanager
def activations_as_declared(reader: SourceReader, layer: torch.nn.Module, prefix: str, index: int, config):
    """While the block runs, decoder layer `index` (materialised, its checkpoint tensors under `prefix`, of
    the model built from `config`) rounds the inputs of its FP8 GEMMs and its KV cache as the checkpoint's
    quantization_config says."""
    tensors = reader.checkpoint.tensors
    where = f"'{reader.checkpoint.folder}' layer {index}"
    fp8 = [n for n, info in tensors.items() if n.startswith(prefix) and info.dtype == FP8_DTYPE]
    roles = {name: reader.family.role(name, len(tensors[name].shape)) for name in fp8}
    experts = [name for name in fp8 if roles[name].kind == Kind.ROUTED_EXPERT]
    handles, linears = [], set()
    for name, module in layer.named_modules():
        weight = f"{prefix}{name}.weight"
        if isinstance(module, torch.nn.Linear) and weight in roles and weight not in experts:
            scale = _input_scale(reader, [weight])
            handles.append(module.register_forward_pre_hook(_linear_hook(reader, scale)))
            linears.add(weight)
    unmatched = [name for name in fp8 if name not in linears and name not in experts]
    if unmatched:
        for handle in handles:
            handle.remove()
        raise UserError(f"{where}: FP8 tensor '{unmatched[0]}' belongs to no Linear of transformers' layer, so its "
                        "activations cannot be quantized as an engine does; evaluate cannot run this checkpoint.")
    module = None
    if experts:
        module = _experts_module(layer, where)
        shards = {name: roles[name].fused.shards if roles[name].fused else (roles[name].shard_id,) for name in experts}
        a13 = _input_scale(reader, [n for n in experts if shards[n] != ("w2",)])
        a2 = _input_scale(reader, [n for n in experts if shards[n] == ("w2",)])
        module.forward = _experts_forward(module, reader, a13, a2)
    try:
        with _kv_cache_as_declared(reader, layer, prefix, config):
            yield
    finally:
        for handle in handles:
            handle.remove()
        if module is not None:
            del module.forward
