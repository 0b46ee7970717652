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
from quantize_moe.source.tiny import TINY_CONFIGS, build_tiny_checkpoint

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
