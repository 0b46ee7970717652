"""Calibration for static activations: the real model run layer by layer over the calibration tokens
(`LayerStreamedModel`), with hooks that record the largest input magnitude of every Linear and of every
routed expert's two projections.

Experts are measured from the input of transformers' own experts module (the MoE block's tokens and
the routing it chose) and that module's fused weights: by default every expert sees every token for
its statistics, so none is left without a scale, while the module itself still runs the true routing and
the next layer sees the real hidden states. `routed_only` measures each expert on its routed tokens; an
expert that got none takes the largest scale of its layer's experts.

For an FP8 KV cache, keys and values are measured where the family's attention hands them to the attention
function (after k_proj/v_proj, any k norm and rotary: what vLLM writes into its cache), by running the
layers under a registered attention implementation that records them and calls the original one."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch

from quantize_moe.adapters.reader import SourceReader
from quantize_moe.errors import UserError
from quantize_moe.quantization.static import W2, W13, ActivationAmax
from quantize_moe.run.activations import plain_gated_experts
from quantize_moe.run.attention import attention_through
from quantize_moe.run.executor import LayerStreamedModel

# Elements of gate/up output computed at a time (experts x tokens x 2I): 32 MB of bf16 on a CPU, where
# calibration's memory is one layer plus the activations; 512 MB on a GPU, where one batched matmul over
# several experts and thousands of tokens runs near the peak and small per-expert ones do not.
_CHUNK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 28}


def _keep_largest(store: dict, key, amax: torch.Tensor) -> None:
    """Running amax kept on the device: no synchronisation per call."""
    store[key] = amax if key not in store else torch.maximum(store[key], amax)


def _largest(store: dict, key, x: torch.Tensor) -> None:
    if x.numel():
        _keep_largest(store, key, x.detach().abs().amax().float())


def _experts_layout(module: torch.nn.Module, name: str) -> None:
    """Only the layout most families share: gate and up concatenated in `gate_up_proj` [E, 2I, H],
    `down_proj` [E, H, I], no biases."""
    if getattr(module, "is_transposed", True) or not plain_gated_experts(module):
        raise UserError(f"The experts of '{name}' are laid out in a way calibration does not measure "
                        "(transposed, interleaved, biased or ungated); use --activations dynamic.")


def _gated_amax(module: torch.nn.Module, tokens: torch.Tensor, first: int, budget: int, count: int = 1) -> torch.Tensor:
    """Largest |act(gate) * up| of experts `first`..`first + count` over `tokens` (w2's inputs), one float32
    per expert, computed as batched matmuls of at most `budget` output elements."""
    width = module.gate_up_proj.shape[1]
    token_step = max(1, min(len(tokens), budget // width))
    expert_step = max(1, budget // (token_step * width))
    largest = torch.zeros(count, dtype=torch.float32, device=tokens.device)
    for start in range(first, first + count, expert_step):
        weights = module.gate_up_proj[start:min(start + expert_step, first + count)].transpose(1, 2)
        group = slice(start - first, start - first + len(weights))
        for row in range(0, len(tokens), token_step):
            gated = module._apply_gate(torch.matmul(tokens[row:row + token_step], weights))  # [e, t, I]
            amax = torch.maximum(gated.amax(dim=(1, 2)), -gated.amin(dim=(1, 2))).float()
            largest[group] = torch.maximum(largest[group], amax)
    return largest


class _Collector:
    """The forward hooks of one calibration run and what they saw, as device tensors."""

    def __init__(self, routed_only: bool):
        self.routed_only = routed_only
        self.linears: dict[str, torch.Tensor] = {}
        self.kv: dict[str, torch.Tensor] = {}
        self.experts: dict[tuple[int, int, str], torch.Tensor] = {}
        self.routed: dict[int, torch.Tensor] = {}

    def linear(self, name: str, module, args) -> None:
        _largest(self.linears, name, args[0])

    def experts_module(self, layer: int, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        experts = module.gate_up_proj.shape[0]
        counts = torch.bincount(index.flatten(), minlength=experts)[:experts]
        self.routed[layer] = counts if layer not in self.routed else self.routed[layer] + counts
        budget = _CHUNK_ELEMENTS.get(hidden.device.type, _CHUNK_ELEMENTS["cpu"])
        if self.routed_only:
            for expert in range(experts):
                tokens = hidden[(index == expert).any(-1)]
                _largest(self.experts, (layer, expert, W13), tokens)
                if len(tokens):
                    _keep_largest(self.experts, (layer, expert, W2), _gated_amax(module, tokens, expert, budget)[0])
            return
        every_token = hidden.abs().amax().float()  # every expert's w13 input: the same tokens for all
        gated = _gated_amax(module, hidden, 0, budget, experts)
        for expert in range(experts):
            _keep_largest(self.experts, (layer, expert, W13), every_token)
            _keep_largest(self.experts, (layer, expert, W2), gated[expert])

    def result(self, tokens: int) -> ActivationAmax:
        for store in (self.linears, self.kv, self.experts):
            bad = next((key for key, value in store.items() if not torch.isfinite(value)), None)
            if bad is not None:
                raise UserError(f"Calibration met NaN or Inf at {bad}: the model diverges on these tokens, so no "
                                "scale can be measured; check the checkpoint or use other calibration data.")
        amax = ActivationAmax(tokens=tokens)
        amax.linears = {name: float(value) for name, value in self.linears.items()}
        amax.kv = {name: float(value) for name, value in self.kv.items()}
        amax.experts = {key: float(value) for key, value in self.experts.items()}
        amax.routed_tokens = {layer: counts.tolist() for layer, counts in self.routed.items()}
        if self.routed_only:
            _fill_unrouted(amax)
        return amax


def _fill_unrouted(amax: ActivationAmax) -> None:
    """Routed-only statistics leave experts that got no token unmeasured: they take their layer's largest."""
    for layer, counts in amax.routed_tokens.items():
        for projection in (W13, W2):
            keys = [(layer, expert, projection) for expert in range(len(counts))]
            largest = max((amax.experts[key] for key in keys if key in amax.experts), default=0.0)
            for key in keys:
                amax.experts.setdefault(key, largest)


KV_ATTENTION = "quantize-moe-kv-calibration"


def _recording_kv(model: LayerStreamedModel, collector: _Collector):
    """Run the model's attention through a recorder of the keys and values it is given (per attention
    module, as `<module>.k_scale` / `.v_scale`)."""
    names = {id(module): name for name, module in model.layers.named_modules(prefix=model.names[model.layers])}

    def record(module, key, value):
        _largest(collector.kv, f"{names[id(module)]}.k_scale", key)
        _largest(collector.kv, f"{names[id(module)]}.v_scale", value)
        return key, value

    return attention_through(model.config, KV_ATTENTION, record, "leave the KV cache in bf16")


def calibrate(reader: SourceReader, batches: list[torch.Tensor], device: str = "cpu", routed_only: bool = False,
              activations: bool = True, kv_cache: bool = False) -> ActivationAmax:
    """Largest input magnitudes of every Linear and routed expert (`activations`) and of the keys and values
    attention caches (`kv_cache`) of every decoder layer, from the model run over `batches` one layer in
    memory at a time."""
    model = LayerStreamedModel(reader, device)
    collector = _Collector(routed_only)
    hooks = []
    for name, module in model.layers.named_modules(prefix=model.names[model.layers]) if activations else ():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(partial(collector.linear, name)))
        elif hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            _experts_layout(module, name)
            layer = int(name.split(".")[2])
            hooks.append(module.register_forward_pre_hook(partial(collector.experts_module, layer), with_kwargs=True))
    try:
        with _recording_kv(model, collector) if kv_cache else nullcontext():
            for _ in model.hidden_states(batches):
                pass
    finally:
        for hook in hooks:
            hook.remove()
        model.model.to("meta")
    return collector.result(sum(batch.numel() for batch in batches))
