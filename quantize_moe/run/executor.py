"""A layer-streamed forward pass: embeddings, each decoder layer, final norm and lm_head, built by transformers
on the meta device and loaded one stage at a time from the checkpoint (FP8 weights dequantized by
SourceReader, FP8 activations rounded as the checkpoint declares: run/activations.py), so peak memory is one layer plus the activations of the token batches, never the model.

Masks, position ids and rotary embeddings are whatever the family's own `*Model.forward` passes each layer:
they are captured by running that forward once per batch with recorders in place of the layers."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from quantize_moe.adapters.reader import SourceReader
from quantize_moe.errors import UserError
from quantize_moe.run.activations import activations_as_declared


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


class LayerStreamedModel:
    """The causal LM of a checkpoint, evaluated stage by stage over a list of token batches."""

    def __init__(self, reader: SourceReader, device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # one "Loading weights" bar per layer otherwise

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
        self.layers = self.model.model.layers

    def _materialise(self, module: torch.nn.Module, prefixes: tuple[str, ...], what: str) -> None:
        """Load the checkpoint tensors under `prefixes` into the meta model through transformers' own
        checkpoint-to-module conversions (fused experts, renamings); every tensor of `module` must get one."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        state = {name: self.reader.get(name) for name in self.reader.names if name.startswith(prefixes)}
        convert_and_load_state_dict_in_model(self.model, state, LoadStateDictConfig(
            dtype=self.dtype, weight_mapping=self.conversions))
        missing = [name for name, tensor in [*module.named_parameters(), *module.named_buffers()] if tensor.is_meta]
        if missing:
            raise UserError(f"The checkpoint '{self.reader.checkpoint.folder}' has no tensor for {what} "
                            f"('{missing[0]}'); it cannot be run layer by layer.")
        module.to(self.device)

    @torch.no_grad()
    def _layer_inputs(self, batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[list[tuple]]]:
        """Embedded hidden states per batch and, per batch, the (args, kwargs) each layer receives."""
        embed = self.model.get_input_embeddings()
        self._materialise(embed, ("model.embed_tokens.",), "the input embeddings")
        rotary = getattr(self.model.model, "rotary_emb", None)
        if rotary is not None:  # its buffers are computed at construction, not stored
            with torch.device(self.device):
                self.model.model.rotary_emb = type(rotary)(config=self.config)
        originals = list(self.layers)
        hidden, per_layer = [], []
        try:
            for batch in batches:
                calls: list = []
                for index in range(len(originals)):
                    self.layers[index] = _Recorder(calls, index == len(originals) - 1)
                try:
                    self.model.model(input_ids=batch.to(self.device), use_cache=False)
                except _Captured:
                    pass
                hidden.append(calls[0][0])
                per_layer.append([(args, kwargs) for _, args, kwargs in calls])
        finally:
            for index, layer in enumerate(originals):
                self.layers[index] = layer
            embed.to("meta")
        return hidden, per_layer

    def check_tokens(self, batches: list[torch.Tensor]) -> None:
        vocab = self.config.vocab_size
        for batch in batches:
            if batch.numel() and (int(batch.min()) < 0 or int(batch.max()) >= vocab):
                raise UserError(f"Token id {int(batch.max())} is outside the vocabulary of "
                                f"'{self.reader.checkpoint.folder}' ({vocab} tokens); tokenize the data for this model.")

    @torch.no_grad()
    def hidden_states(self, batches: list[torch.Tensor]) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """(layer index, output hidden states per batch) after each decoder layer, in order; only one
        layer's weights are in memory at a time."""
        self.check_tokens(batches)
        hidden, per_layer = self._layer_inputs(batches)
        for index, layer in enumerate(self.layers):
            self._materialise(layer, (f"model.layers.{index}.",), f"layer {index}")
            with activations_as_declared(self.reader, layer, index):
                for b, calls in enumerate(per_layer):
                    args, kwargs = calls[index]
                    out = layer(hidden[b], *args, **kwargs)
                    hidden[b] = out[0] if isinstance(out, tuple) else out
            layer.to("meta")
            yield index, hidden

    @torch.no_grad()
    def logits(self, batches: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Float32 logits per batch, computed after the last layer."""
        hidden = []
        for _, hidden in self.hidden_states(batches):
            pass
        norm, head = self.model.model.norm, self.model.get_output_embeddings()
        head_prefix = "model.embed_tokens." if getattr(self.config, "tie_word_embeddings", False) else "lm_head."
        self._materialise(norm, ("model.norm.",), "the final norm")
        if head_prefix == "lm_head.":
            self._materialise(head, ("lm_head.",), "lm_head")
            weight = head.weight
        else:
            embed = self.model.get_input_embeddings()
            self._materialise(embed, (head_prefix,), "the tied embeddings")
            weight = embed.weight
        try:
            for states in hidden:
                yield torch.nn.functional.linear(norm(states), weight).float()
        finally:
            norm.to("meta")
            self.model.to("meta")
