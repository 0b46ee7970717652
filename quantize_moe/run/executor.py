"""A layer-streamed forward pass: embeddings, each decoder layer, final norm and lm_head, built by transformers
on the meta device and loaded one stage at a time from the checkpoint (FP8 weights dequantized by
SourceReader, FP8 activations rounded as the checkpoint declares: run/activations.py), so peak memory is
one layer plus the activations of the token batches, never the model.

Masks, position ids and rotary embeddings are whatever the family's own base-model forward passes each
layer: they are captured by running that forward once per batch with recorders in place of the layers. The
logits come from the family's own `*ForCausalLM.forward` with the base model replaced by the final norm, so
what a family does after it (Granite's logit scaling) is done too."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from quantize_moe.adapters.reader import SourceReader
from quantize_moe.errors import UserError
from quantize_moe.source.checkpoint import READ_THREADS
from quantize_moe.run.activations import activations_as_declared
from quantize_moe.run.placement import FusedPlacement


_LIBC = ctypes.CDLL(None)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MMAP_THRESHOLD_BYTES = 1 << 20


def _map_large_tensors() -> None:
    """Blocks of 1 MB and more straight from the system, returned to it when freed: glibc otherwise raises
    its mmap threshold to the largest block freed (up to 32 MB), so the tensors of a layer's load (and the
    float32 intermediates of dequantizing FP8) come from the heap, whose freed pages stay counted in the
    process until trimmed (measured: 2.6 layers at the peak of loading an FP8 layer instead of 1.3;
    scripts/bench_evaluate.py, docs/performance.md). Setting it fixes the threshold for the process."""
    if hasattr(_LIBC, "mallopt"):  # glibc; other C libraries return large blocks themselves
        _LIBC.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


def _return_freed_memory() -> None:
    """Hand the heap pages of freed tensors below the mmap threshold (a layer's load, a layer) back to the
    system (measured: about one layer more per layer without it; docs/performance.md)."""
    if hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


class _Handed:
    """A tensor already read (or a parameter already filled in place), handed over when transformers'
    loader materialises it (`tensor[...]`, as it does a safetensors slice): from then on only the loader
    holds it, which frees each expert's sources as it stacks them into a fused parameter."""

    def __init__(self, tensors: dict[str, torch.Tensor], name: str):
        self.tensors, self.name = tensors, name

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensors.pop(self.name)[index]


class _Captured(Exception):
    """Raised by the last recorder: the rest of the model's forward is not needed."""


class _Recorder(torch.nn.Module):
    """Stands in for one decoder layer: records the arguments the model's forward passes it."""

    def __init__(self, calls: list, last: bool):
        super().__init__()
        self.calls, self.last = calls, last

    def forward(self, hidden_states, *args, **kwargs):
        self.calls.append((hidden_states, args, kwargs))
        if self.last:
            raise _Captured
        return hidden_states


class _BaseOutput:
    """What a base model returns to its causal LM: the last hidden state, nothing else (no cache, no router
    logits: those are None, as without `use_cache` and `output_router_logits`)."""

    def __init__(self, last_hidden_state: torch.Tensor):
        self.last_hidden_state = last_hidden_state

    def __getattr__(self, name):
        return None

    def __getitem__(self, index):
        return (self.last_hidden_state,)[index]


class _FinalNorm(torch.nn.Module):
    """Stands in for the base model in the causal LM's forward: the final norm of the given hidden states."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm, self.states = norm, None

    def forward(self, *args, **kwargs):
        return _BaseOutput(self.norm(self.states))


class LayerStreamedModel:
    """The causal LM of a checkpoint, evaluated stage by stage over a list of token batches."""

    def __init__(self, reader: SourceReader, device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # one "Loading weights" bar per call otherwise
        _map_large_tensors()

        self.reader, self.device, self.dtype = reader, torch.device(device), dtype
        folder = reader.checkpoint.folder
        try:
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
            with torch.device("meta"):
                self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        except Exception as error:  # transformers raises many kinds; the sentence is what matters
            raise UserError(f"transformers cannot build the layers of '{folder}' offline ({error}); "
                            "this family cannot be run layer by layer.") from None
        self.config = self.model.config
        self.conversions = get_model_conversion_mapping(self.model, None, None)
        self.converters = {pattern: converter for converter in self.conversions
                           if isinstance(converter, WeightConverter) for pattern in converter.source_patterns}
        self.meta_state = self.model.state_dict()  # its parameters' and buffers' names (meta: no memory)
        self.names = {module: name for name, module in self.model.named_modules()}
        # The decoder layers are the first ModuleList (the embeddings come before them); their parent is
        # the base model (`model`, DBRX's `transformer`), whose other child with weights is the final norm.
        layers = next((name for name, m in self.model.named_modules() if isinstance(m, torch.nn.ModuleList)), None)
        self.base_name = layers.rpartition(".")[0] if layers else ""
        self.base = self.model.get_submodule(self.base_name)
        self.embed, self.lm_head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        norms = [m for m in self.base.children() if m is not self.embed and not isinstance(m, torch.nn.ModuleList)
                 and next(m.parameters(), None) is not None]
        if not self.base_name or len(norms) != 1 or self.lm_head is None:
            raise UserError(f"'{folder}' is a {type(self.model).__name__}, whose decoder layers, final norm and "
                            "lm_head are not laid out as in a causal LM; it cannot be run layer by layer.")
        self.layers, self.norm = self.model.get_submodule(layers), norms[0]

    def _names(self, prefix: str) -> list[str]:
        """The checkpoint tensors under `prefix`, as the family's model holds them (`SourceReader.model_names`)."""
        return [name for name in self.reader.model_names if name.startswith(prefix)]

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """These checkpoint tensors in high precision, read (and dequantized) by several threads."""
        with ThreadPoolExecutor(READ_THREADS) as pool:
            return dict(zip(names, pool.map(self.reader.get, names)))

    def _groups(self, prefix: str) -> list[tuple[str, dict[str, str | None]]]:
        """The tensors under `prefix` by the parameter transformers' renamings and conversions make of them
        (every expert's gate and up: one `gate_up_proj`), each with the converter's source pattern it
        matched (None where only renamed), the groups of most tensors first."""
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        renamings = [t for t in self.conversions if isinstance(t, WeightRenaming)]
        converters = [t for t in self.conversions if isinstance(t, WeightConverter)]
        groups: dict[str, dict[str, str | None]] = {}
        for name in self._names(prefix):
            target, pattern = rename_source_key(name, renamings, converters, self.model.base_model_prefix,
                                                self.meta_state)
            groups.setdefault(target if target in self.meta_state else name, {})[name] = pattern
        return sorted(groups.items(), key=lambda group: len(group[1]), reverse=True)

    def _placement(self, target: str, patterns: dict[str, str | None]) -> FusedPlacement | None:
        """How the parameter `target` is filled in place from its checkpoint tensors (`patterns`: name ->
        source pattern), when one converter makes it by operations placed directly (run/placement.py)."""
        converters = {self.converters.get(pattern) for pattern in patterns.values()}
        if target not in self.meta_state or len(converters) != 1 or None in converters:
            return None
        shapes = {name: torch.Size(self.reader.checkpoint.tensors[name].shape) for name in patterns
                  if name in self.reader.checkpoint.tensors}
        return FusedPlacement.of(converters.pop(), patterns, shapes, self.meta_state[target])

    def _materialise(self, module: torch.nn.Module, what: str, prefix: str | None = None,
                     state: dict[str, torch.Tensor] | None = None) -> None:
        """Load the checkpoint tensors under `module`'s name (or `prefix`; from `state` when already read)
        into the meta model, one target parameter at a time: a fused expert parameter filled in place
        (run/placement.py: its sources read straight into their slices), any other through transformers'
        own checkpoint-to-module conversions (renamings, other fusions) with its tensors read in parallel,
        so the loader holds one group's sources beside its converted copy, not the whole layer's (from
        `state`, the layer's other tensors too). Every tensor of `module` must get one."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        for target, patterns in self._groups(prefix or self.names[module] + "."):
            placement = self._placement(target, patterns)
            if placement is not None:  # handed to the loader as the finished parameter, to set as it sets any
                fill = self.reader.read_into if state is None else lambda name, out: out.copy_(state.pop(name))
                tensors, mapping = {target: placement.fill(fill, READ_THREADS)}, []
            elif state is not None:
                tensors, mapping = {name: state.pop(name) for name in patterns}, self.conversions
            else:
                tensors, mapping = self._read(list(patterns)), self.conversions
            convert_and_load_state_dict_in_model(self.model, {name: _Handed(tensors, name) for name in tensors},
                                                 LoadStateDictConfig(dtype=self.dtype, weight_mapping=mapping))
            tensors.clear()  # any the loader did not take
        _return_freed_memory()  # the per-expert tensors fused into copies, the float32 of dequantizing FP8
        missing = [name for name, tensor in [*module.named_parameters(), *module.named_buffers()] if tensor.is_meta]
        if missing:  # named as transformers' model names it (a multimodal wrapper's decoder sits elsewhere)
            raise UserError(f"The checkpoint '{self.reader.checkpoint.folder}' has no tensor for {what} "
                            f"('{self.names[module]}.{missing[0]}'); it cannot be run layer by layer.")
        module.to(self.device)

    @torch.no_grad()
    def _layer_inputs(self, batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[list[tuple]]]:
        """Embedded hidden states per batch and, per batch, the (args, kwargs) each layer receives."""
        self._materialise(self.embed, "the input embeddings")
        rotary = getattr(self.base, "rotary_emb", None)
        if rotary is not None:  # its buffers are computed at construction, not stored
            with torch.device(self.device):
                self.base.rotary_emb = type(rotary)(config=self.config)
        originals = list(self.layers)
        hidden, per_layer = [], []
        try:
            for batch in batches:
                calls: list = []
                for index in range(len(originals)):
                    self.layers[index] = _Recorder(calls, index == len(originals) - 1)
                try:
                    self.base(input_ids=batch.to(self.device), use_cache=False)
                except _Captured:
                    pass
                hidden.append(calls[0][0])
                per_layer.append([(args, kwargs) for _, args, kwargs in calls])
        finally:
            for index, layer in enumerate(originals):
                self.layers[index] = layer
            self.embed.to("meta")
        return hidden, per_layer

    def check_tokens(self, batches: list[torch.Tensor]) -> None:
        vocab = self.embed.num_embeddings
        for batch in batches:
            if batch.numel() and (int(batch.min()) < 0 or int(batch.max()) >= vocab):
                raise UserError(f"Token id {int(batch.max())} is outside the vocabulary of "
                                f"'{self.reader.checkpoint.folder}' ({vocab} tokens); tokenize the data for this model.")

    @torch.no_grad()
    def hidden_states(self, batches: list[torch.Tensor]) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """(layer index, output hidden states per batch) after each decoder layer, in order; only one
        layer's weights are in memory at a time (on a GPU, plus the next one's read on the host while this
        one runs, and held there while it is loaded), and none of the current layer while the caller holds
        a yielded value."""
        self.check_tokens(batches)
        hidden, per_layer = self._layer_inputs(batches)
        prefixes = [self.names[layer] + "." for layer in self.layers]
        # On a CPU the read would share the cores and the memory with the layer's forward: layers load in turn.
        ahead = ThreadPoolExecutor(1) if self.device.type != "cpu" else None
        pending = None
        try:
            for index, layer in enumerate(self.layers):
                state = pending.result() if pending is not None else None
                pending = None
                self._materialise(layer, f"layer {index}", state=state)
                if ahead is not None and index + 1 < len(prefixes):
                    pending = ahead.submit(self._read, self._names(prefixes[index + 1]))
                with activations_as_declared(self.reader, layer, prefixes[index], index, self.config):
                    for b, calls in enumerate(per_layer):
                        args, kwargs = calls[index]
                        out = layer(hidden[b], *args, **kwargs)
                        hidden[b] = out[0] if isinstance(out, tuple) else out
                layer.to("meta")
                _return_freed_memory()
                yield index, hidden
        finally:
            if ahead is not None:
                ahead.shutdown(cancel_futures=True)

    @torch.no_grad()
    def outputs_of(self, batches: list[torch.Tensor], modules: dict[int, str]) -> Iterator[tuple[int, torch.Tensor]]:
        """(layer, outputs `[tokens, ...]` over every batch) of the module at path `modules[layer]` inside
        decoder layer `layer` (e.g. the norm whose output enters its MoE block), after each such layer."""
        captured: list[torch.Tensor] = []
        handles = []
        try:
            for index, path in modules.items():
                try:
                    module = self.model.get_submodule(path)
                except AttributeError:
                    raise UserError(f"transformers' model of '{self.reader.checkpoint.folder}' has no module "
                                    f"'{path}' to read layer {index}'s hidden states from.") from None
                handles.append(module.register_forward_hook(
                    lambda _, __, out: captured.append((out[0] if isinstance(out, tuple) else out).flatten(0, -2))))
            for index, _ in self.hidden_states(batches):
                if index in modules:
                    yield index, torch.cat(captured)
                captured.clear()
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def head(self, hidden: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Float32 logits per batch of the last layer's hidden states, through the family's causal-LM forward."""
        self._materialise(self.norm, "the final norm")
        if getattr(self.config, "tie_word_embeddings", False):
            self._materialise(self.embed, "the tied embeddings")
            self.lm_head.weight = self.embed.weight
        else:
            self._materialise(self.lm_head, "lm_head")
        final = _FinalNorm(self.norm)
        self.model.set_submodule(self.base_name, final)
        try:
            for states in hidden:
                final.states = states
                yield self.model(input_ids=torch.zeros(states.shape[:2], dtype=torch.long)).logits.float()
        finally:
            self.model.set_submodule(self.base_name, self.base)
            self.model.to("meta")

    def logits(self, batches: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Float32 logits per batch: every layer, then the head."""
        hidden = []
        for _, hidden in self.hidden_states(batches):
            pass
        yield from self.head(hidden)
