"""`validate --data`: each MoE layer is fed the hidden states the real model feeds it on real tokens, captured
by the layer-streamed forward of SRC; they equal what transformers' full forward passes the MoE block."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from quantize_moe.check.validate import validate
from quantize_moe.cli.app import app
from quantize_moe.plan.options import Options
from quantize_moe.source.tiny import build_tiny_checkpoint
from quantize_moe.write.job import quantize_checkpoint

runner = CliRunner()
MOE_BLOCK = {"mixtral": "mlp", "deepseek_v3": "mlp", "qwen3_next": "mlp", "jamba": "feed_forward", "dbrx": "ffn"}


def _pair(family, root):
    src = build_tiny_checkpoint(family, root / "src")
    quantize_checkpoint(src, root / "dst", Options(), show_progress=False)
    save_file({"input_ids": torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(0))},
              root / "ids.safetensors")
    return src, root / "dst", root / "ids.safetensors"


@pytest.mark.parametrize("family", MOE_BLOCK)
def test_captured_inputs_are_what_the_full_forward_feeds_each_moe_block(family, tmp_path):
    src, dst, ids_file = _pair(family, tmp_path)
    ids = load_file(ids_file)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    seen = {}
    for index, layer in enumerate(getattr(model.base_model, "layers", None) or model.base_model.blocks):
        block = getattr(layer, MOE_BLOCK[family], None)
        if hasattr(block, "experts"):  # dense layers have an MLP without experts, or none (Jamba)
            block.register_forward_pre_hook(lambda _, args, index=index: seen.setdefault(f"layers.{index}", []).append(
                args[0].flatten(0, -2)))
    with torch.no_grad():  # one row per forward, as the streamed run batches them: the same bf16 kernels
        for row in ids:
            model(input_ids=row[None])
    save_file({k: torch.cat(v) for k, v in seen.items()}, tmp_path / "captured.safetensors")

    streamed = validate(src, dst, batches=[row[None] for row in ids], device="cpu")
    assert [f"layers.{r.layer}" for r in streamed.layers] == sorted(seen)
    from_file = validate(src, dst, hidden_states_file=tmp_path / "captured.safetensors", device="cpu")
    for got, want in zip(streamed.layers, from_file.layers):
        assert got.tokens == want.tokens == ids.numel()
        assert got.relative_error == pytest.approx(want.relative_error, rel=1e-6), family
        assert got.experts_with_tokens == want.experts_with_tokens


def test_cli_data_and_its_conflict_with_hidden_states(tmp_path):
    src, dst, ids = _pair("mixtral", tmp_path)
    real = runner.invoke(app, ["validate", str(src), str(dst), "--data", str(ids), "--device", "cpu", "--json", "-"])
    assert real.exit_code == 0, real.output
    drawn = runner.invoke(app, ["validate", str(src), str(dst), "--device", "cpu", "--json", "-"])
    real_layers, drawn_layers = json.loads(real.output)["layers"], json.loads(drawn.output)["layers"]
    assert [r["tokens"] for r in real_layers] == [3 * 17] * 2 and drawn_layers[0]["tokens"] == 512
    assert real_layers[0]["relative_error"] != drawn_layers[0]["relative_error"]
    both = runner.invoke(app, ["validate", str(src), str(dst), "--data", str(ids), "--hidden-states", str(ids)])
    assert both.exit_code == 2 and "pass one of them" in both.output
    bad = runner.invoke(app, ["validate", str(src), str(dst), "--data", str(tmp_path / "absent.safetensors")])
    assert bad.exit_code == 1 and "does not exist" in bad.output and "Traceback" not in bad.output
