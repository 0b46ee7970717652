"""The layer-streamed executor computes what transformers' own full-model forward computes."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantize_moe.adapters.reader import SourceReader
from quantize_moe.errors import UserError
from quantize_moe.run.executor import LayerStreamedModel
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.tiny import TINY_CONFIGS, build_tiny_checkpoint, to_block_fp8

TRAINED = Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures" / "tiny-mixtral-trained"


def _perplexities(folder: Path, batches: list[torch.Tensor]) -> tuple[float, float]:
    def nll(logits, batch):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")

    streamed = LayerStreamedModel(SourceReader(Checkpoint(folder)))
    got = sum(nll(logits, batch) for logits, batch in zip(streamed.logits(batches), batches))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = sum(nll(model(input_ids=batch).logits.float(), batch) for batch in batches)
    tokens = sum(batch[:, 1:].numel() for batch in batches)
    return torch.exp(got / tokens).item(), torch.exp(want / tokens).item()


@pytest.mark.parametrize("family, overrides", [
    *((family, {}) for family in TINY_CONFIGS),
    ("granitemoe", dict(logits_scaling=4.0)),  # done by the causal LM after the base model
    ("mixtral", dict(tie_word_embeddings=True)),
])
def test_streamed_perplexity_matches_transformers(family, overrides, tmp_path):
    folder = build_tiny_checkpoint(family, tmp_path / family, **overrides)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (2, 24), generator=generator) for _ in range(2)]
    got, want = _perplexities(folder, batches)
    assert abs(got / want - 1) < 1e-3, (got, want)


@pytest.mark.skipif(not TRAINED.is_dir(), reason="shared fixtures absent")
def test_streamed_perplexity_matches_transformers_on_trained_fixture():
    data = (TRAINED.parent / "heldout-python-source.bin").read_bytes()[:4 * 257]
    batches = [torch.frombuffer(bytearray(data), dtype=torch.uint8).long().reshape(4, 257)]
    got, want = _perplexities(TRAINED, batches)
    assert abs(got / want - 1) < 1e-3, (got, want)
    assert got < 10  # a trained model, not noise


def test_token_out_of_vocab_is_one_sentence(tmp_path):
    folder = build_tiny_checkpoint("mixtral", tmp_path / "m")
    with pytest.raises(UserError, match="outside the vocabulary"):
        list(LayerStreamedModel(SourceReader(Checkpoint(folder))).logits([torch.full((1, 4), 500)]))


def test_family_transformers_cannot_build_is_one_sentence(tmp_path):
    folder = build_tiny_checkpoint("mixtral", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "not_a_family"}))
    with pytest.raises(UserError, match="transformers cannot build the layers of .* offline"):
        LayerStreamedModel(SourceReader(Checkpoint(folder), adapter="generic"))


def _loaded_layers(folder: Path, monkeypatch, in_place: bool,
                   ahead: bool = False) -> tuple[list[dict[str, torch.Tensor]], set, list]:
    """Every decoder layer's parameters as the executor loads them (in place, or all through transformers'
    loader; from the layer's tensors read ahead, as on a GPU, or read as they are placed), the fused
    parameters filled in place, and the tensors read whole through `SourceReader.get`."""
    placed, read_whole = set(), []
    placement = LayerStreamedModel._placement

    def recorded(self, target, patterns):
        found = placement(self, target, patterns) if in_place else None
        if found is not None:
            placed.add(target)
        return found

    with monkeypatch.context() as patch:
        patch.setattr(LayerStreamedModel, "_placement", recorded)
        get = SourceReader.get
        patch.setattr(SourceReader, "get", lambda self, name: read_whole.append(name) or get(self, name))
        streamed = LayerStreamedModel(SourceReader(Checkpoint(folder)))
        layers = []
        for index, layer in enumerate(streamed.layers):
            state = streamed._read(streamed._names(f"model.layers.{index}.")) if ahead else None
            streamed._materialise(layer, f"layer {index}", state=state)
            layers.append({name: tensor.clone() for name, tensor in layer.state_dict().items()})
            layer.to("meta")
    return layers, placed, read_whole


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("fp8, ahead", [(False, False), (True, False), (False, True)],
                         ids=["bf16", "block-fp8", "bf16-read-ahead"])
def test_fused_experts_are_filled_in_place_as_transformers_loader_fuses_them(family, fp8, ahead, tmp_path,
                                                                             monkeypatch):
    """Every layer's `gate_up_proj` and `down_proj` is allocated once and each expert's tensors read (FP8:
    dequantized) straight into their slice, never read whole (or copied from the layer read ahead); the
    parameters are those transformers' loader makes by stacking and concatenating them, bit for bit."""
    folder = build_tiny_checkpoint(family, tmp_path / "bf16")
    if fp8:
        folder = to_block_fp8(folder, tmp_path / "fp8", (32, 32))
    got, placed, read_whole = _loaded_layers(folder, monkeypatch, in_place=True, ahead=ahead)
    want, _, _ = _loaded_layers(folder, monkeypatch, in_place=False)
    assert placed == {f"model.layers.{index}.mlp.experts.{name}" for index in range(len(got))
                      for name in ("gate_up_proj", "down_proj")}
    assert ahead or not [name for name in read_whole if ".experts." in name]
    assert [sorted(layer) for layer in got] == [sorted(layer) for layer in want]
    for index, (layer, reference) in enumerate(zip(got, want)):
        for name, tensor in layer.items():
            assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name]), (index, name)
    if not fp8:  # and as transformers' own from_pretrained loads them
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).state_dict()
        for index, layer in enumerate(got):
            for name, tensor in layer.items():
                assert torch.equal(tensor, model[f"model.layers.{index}.{name}"]), (index, name)
