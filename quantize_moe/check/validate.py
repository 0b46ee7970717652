"""Layer-by-layer validation: the same fused-MoE layer run with the original and the FP8 experts.

For every MoE layer, the bf16 experts of SRC and the FP8 experts of DST are loaded
through the same weight loader into `FusedMoE` layers, fed the same hidden states
(seeded, scaled by the layer's own input RMSNorm weight; read from a file; or captured at the
output of that norm by the layer-streamed forward of SRC over real tokens),
routed by the layer's real router weights with the family's rule (Llama-4's router
weight scales the expert input, as in transformers), and compared. The FP8 side quantizes
its activations as the checkpoint declares, with its static input scales if it has them. Families whose
experts the fused-MoE layer cannot compute (gpt-oss) are refused.
A float64 torch reference of each separates kernel error from quantization error.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from quantize_moe.check.thresholds import Thresholds
from quantize_moe.errors import UsageError, UserError
from quantize_moe.moe.layer import FusedMoE
from quantize_moe.check.moe_layers import MoECheckpoint
from quantize_moe.moe.reference import fused_experts_reference
from quantize_moe.moe.routing import route
from quantize_moe.write.pipeline import pick_device


@dataclass(frozen=True)
class LayerResult:
    layer: int
    tokens: int
    experts_with_tokens: int
    num_experts: int
    relative_error: float  # ||fp8 - bf16|| / ||bf16||, both through the same path
    cosine: float
    max_error: float  # max |fp8 - bf16| / max |bf16|
    bf16_kernel_error: float  # bf16 path vs float64 reference of the bf16 weights
    fp8_kernel_error: float  # fp8 path vs float64 reference of the fp8 weights (activations quantized too)
    quantization_error: float  # float64 reference: fp8 weights and activations vs bf16 weights
    passed: bool


@dataclass(frozen=True)
class ValidationReport:
    src: str
    dst: str
    device: str
    path: str  # "triton" or "torch reference"
    reference_dtype: str
    thresholds: Thresholds
    layers: list[LayerResult]
    routing_note: str = ""  # when the routing rule is a guess (the generic adapter)

    @property
    def passed(self) -> bool:
        return all(layer.passed for layer in self.layers)

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _hidden_states(moe: MoECheckpoint, layer: int, tokens: int, seed: int, file: Path | None,
                   device: torch.device) -> torch.Tensor:
    """Real hidden states from `file`, or seeded ones with the RMS the MoE block really sees: unit-RMS
    rows times the weight of the RMSNorm in front of the block."""
    hidden = moe.layers[layer].hidden_size
    if file is not None:
        try:
            with safe_open(file, framework="pt") as f:
                key = next((k for k in (f"layers.{layer}", "hidden_states") if k in f.keys()), None)
                if key is None:
                    raise UserError(f"'{file}' holds neither 'layers.{layer}' nor 'hidden_states'; save the "
                                    "hidden states entering each MoE layer under one of those names.")
                x = f.get_tensor(key)
        except SafetensorError as e:
            raise UserError(f"'{file}' is not a readable safetensors file ({e}).") from None
        if x.dim() != 2 or x.shape[1] != hidden:
            raise UserError(f"'{file}' tensor for layer {layer} has shape {tuple(x.shape)}; expected "
                            f"[tokens, {hidden}].")
        return x.to(device, torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed * 100_003 + layer))
    norm = moe.family.layer_tensor(moe.checkpoint.tensors, layer, rf"{moe.family.moe_input_norm}\.weight")
    if norm is not None:
        x = x * (moe.checkpoint.get(norm).float() + float(moe.family.zero_centered_norm))
    return x.to(device, torch.bfloat16)


def _outputs(layer: FusedMoE, x, weights, ids, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's output in float32, its torch reference in `dtype`). Off the GPU the layer's path is
    that same float32 reference rounded to x's dtype, so a float32 reference is computed once, not twice."""
    reference = fused_experts_reference(x, layer.w13_weight, layer.w2_weight, weights, ids,
                                        **layer.quant_method.kernel_args(layer), compute_dtype=dtype)
    if not x.is_cuda and dtype == torch.float32:
        return reference.to(x.dtype).float(), reference
    return layer(x, weights, ids).float(), reference


def _streamed_inputs(moe: MoECheckpoint, layers: list[int], batches: list[torch.Tensor], device: torch.device,
                     adapter: str | None):
    """(layer, hidden states entering its MoE block) over `batches`, from the streamed forward of the
    checkpoint: the output of the norm in front of the block, one decoder layer in memory at a time."""
    from quantize_moe.adapters.reader import SourceReader
    from quantize_moe.run.executor import LayerStreamedModel

    norms = {}
    for layer in layers:
        norm = moe.family.layer_tensor(moe.checkpoint.tensors, layer, rf"{moe.family.moe_input_norm}\.weight")
        if norm is None:
            raise UserError(f"'{moe.checkpoint.folder}' has no norm in front of MoE layer {layer}, where --data "
                            "would read its hidden states; give --hidden-states instead.")
        norms[layer] = norm.removesuffix(".weight")
    # SRC's open checkpoint, shared: its owner closes it
    yield from LayerStreamedModel(SourceReader(moe.checkpoint, adapter=adapter), str(device)).outputs_of(batches, norms)


def validate_layer(src: MoECheckpoint, dst: MoECheckpoint, layer: int, x: torch.Tensor, *, device: torch.device,
                   reference_dtype: torch.dtype, thresholds: Thresholds,
                   on_loaded: Callable[[int, FusedMoE, FusedMoE], None] | None = None,
                   loaded: Future | None = None) -> LayerResult:
    """One MoE layer; `loaded`, the layer's (SRC, DST) `FusedMoE`s read while the layer before ran, else
    each is read here in turn (SRC's freed before DST's is read, unless `on_loaded` wants both)."""
    info = src.layers[layer]
    router = {k: v.to(device) for k, v in src.load_router(layer).items()}
    x, weights, ids = route(x, router, src.family.routing_rule(src.config, router, layer))

    original, quantized = loaded.result() if loaded is not None else (src.load_layer(layer, device), None)
    out_bf16, ref_bf16 = _outputs(original, x, weights, ids, reference_dtype)
    if quantized is None:
        if on_loaded is None:
            original = None  # freed before DST's layer is loaded
        quantized = dst.load_layer(layer, device)
    out_fp8, ref_fp8 = _outputs(quantized, x, weights, ids, reference_dtype)
    if on_loaded is not None:
        on_loaded(layer, original, quantized)
    del original, quantized

    relative = _relative(out_fp8, out_bf16)
    cosine = torch.nn.functional.cosine_similarity(out_fp8.double().flatten(), out_bf16.double().flatten(),
                                                   dim=0).item()
    kernel_errors = (_relative(out_bf16, ref_bf16), _relative(out_fp8, ref_fp8))
    passed = (relative <= thresholds.max_relative_error and cosine >= thresholds.min_cosine
              and max(kernel_errors) <= thresholds.max_kernel_error)
    return LayerResult(
        layer=layer, tokens=x.shape[0], experts_with_tokens=int(ids.unique().numel()),
        num_experts=info.num_experts, relative_error=relative, cosine=cosine,
        max_error=((out_fp8 - out_bf16).abs().max() / out_bf16.abs().max().clamp_min(1e-30)).item(),
        bf16_kernel_error=kernel_errors[0], fp8_kernel_error=kernel_errors[1],
        quantization_error=_relative(ref_fp8, ref_bf16), passed=passed)


def _check_same_model(source: MoECheckpoint, produced: MoECheckpoint, src, dst) -> None:
    """DST must be SRC's model: the same family and, layer by layer, the same experts and shapes."""
    if source.family.name != produced.family.name:
        raise UserError(f"SRC '{src}' is a {source.family.name} checkpoint but DST '{dst}' is a "
                        f"{produced.family.name} one; validate DST against the checkpoint it was made from.")
    if sorted(source.layers) != sorted(produced.layers):
        raise UserError(f"SRC '{src}' and DST '{dst}' have different MoE layers; is DST made from SRC?")
    for layer, info in source.layers.items():
        theirs = produced.layers[layer]
        mine = (info.num_experts, info.hidden_size, info.expert_width)
        if mine != (theirs.num_experts, theirs.hidden_size, theirs.expert_width):
            raise UserError(f"MoE layer {layer} has {mine[0]} experts of hidden size {mine[1]} and width {mine[2]} "
                            f"in SRC '{src}', but {theirs.num_experts}, {theirs.hidden_size} and {theirs.expert_width} "
                            "in DST; validate DST against the checkpoint it was made from.")


def validate(src: str | Path, dst: str | Path, *, tokens: int = 512, seed: int = 0, device: str = "auto",
             hidden_states_file: Path | None = None, batches: list[torch.Tensor] | None = None,
             layers: list[int] | None = None, thresholds: Thresholds = Thresholds(), on_layer=None,
             adapter: str | None = None,
             on_loaded: Callable[[int, FusedMoE, FusedMoE], None] | None = None) -> ValidationReport:
    """Validate every MoE layer (or `layers`) of DST against SRC; `on_layer(result, total)` sees each result.
    Hidden states are drawn, read from `hidden_states_file`, or captured over the token `batches` by the
    streamed forward of SRC. `adapter="generic"` reads both through the generic adapter. `on_loaded(layer,
    original, quantized)` sees both loaded layers before they are freed (verify's weight check, which
    then reads no expert again); they are held at once for it, one at a time without."""
    if batches is not None and hidden_states_file is not None:
        raise UsageError("--data and --hidden-states both give hidden states; pass one of them.")
    source, produced = MoECheckpoint.open(src, adapter), MoECheckpoint.open(dst, adapter)
    if source.spec.is_fp8:
        raise UserError(f"SRC '{src}' is already quantized; validate compares an unquantized SRC with DST.")
    if source.family.activation != "silu":
        raise UserError(f"SRC '{src}' is a {source.family.name} checkpoint, which validate cannot check: its experts "
                        f"use biases and a {source.family.activation} activation that the fused-MoE layer it "
                        "runs does not compute.")
    _check_same_model(source, produced, src, dst)
    torch_device = pick_device(device)
    chosen = sorted(source.layers if layers is None else set(layers))  # the order the streamed forward reaches them
    unknown = [layer for layer in chosen if layer not in source.layers]
    if unknown:
        raise UserError(f"--layers names layer {unknown[0]}, which is not an MoE layer of '{src}'.")
    # The reference dequantizes one expert at a time: its w13 (2I x H), the scale expanded over it and their
    # product, in float64 unless those three would not fit in a quarter of the free memory.
    expert_w13 = max((2 * source.layers[layer].hidden_size * source.layers[layer].expert_width for layer in chosen),
                     default=0)
    free = torch.cuda.mem_get_info(torch_device)[0] if torch_device.type == "cuda" else 16 * 2**30
    reference_dtype = torch.float64 if 3 * 8 * expert_w13 < free // 4 else torch.float32

    if batches is not None:
        inputs = _streamed_inputs(source, chosen, batches, torch_device, adapter)
    else:
        inputs = ((layer, _hidden_states(source, layer, tokens, seed, hidden_states_file, torch_device))
                  for layer in chosen)
    # On a GPU the next layer of both is read (onto the GPU) while this one runs, so the disk does not wait
    # for the kernels; on the CPU that would hold a second layer in host memory.
    ahead = ThreadPoolExecutor(1, "validate-read") if torch_device.type == "cuda" else None
    pending: dict[int, Future] = {}

    def read(layer: int) -> tuple[FusedMoE, FusedMoE]:
        return source.load_layer(layer, torch_device), produced.load_layer(layer, torch_device)

    results = []
    try:
        for index, (layer, x) in enumerate(inputs):  # in `chosen`'s order
            for upcoming in chosen[index:index + 2] if ahead is not None else []:
                if upcoming not in pending:
                    pending[upcoming] = ahead.submit(read, upcoming)
            result = validate_layer(source, produced, layer, x, device=torch_device, reference_dtype=reference_dtype,
                                    thresholds=thresholds, on_loaded=on_loaded, loaded=pending.pop(layer, None))
            results.append(result)
            if on_layer is not None:
                on_layer(result, len(chosen))
    finally:
        if ahead is not None:
            ahead.shutdown(cancel_futures=True)
    return ValidationReport(str(src), str(dst), str(torch_device),
                            "triton" if torch_device.type == "cuda" else "torch reference",
                            str(reference_dtype).removeprefix("torch."), thresholds, results,
                            source.family.routing_note)
