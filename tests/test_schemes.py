"""Schemes, formats and the choice between them: scale arithmetic, the engine table's rules, what the
plan keeps or refuses, and the tensors and configs each combination writes."""

import math
import re

import pytest
import torch
from typer.testing import CliRunner

from quantize_moe.quantization import fp8
from quantize_moe.check.weights import check_expert_weights
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.cli.app import app
from quantize_moe.plan.compatibility import LOADS, block_tp_sizes
from quantize_moe.errors import UserError
from quantize_moe.quantization.formats import ignore_entries, read_quantization
from quantize_moe.quantization.spec import MoEQuantSpec, expand_weight_scale
from quantize_moe.plan.plan import make_plan
from quantize_moe.plan.options import Options
from quantize_moe.write.job import quantize_checkpoint
from quantize_moe.quantization.schemes import SCHEMES

EXPERT = "model.layers.1.block_sparse_moe.experts.2"


@pytest.fixture(scope="session")
def narrow_mixtral(tiny_checkpoint):
    """Hidden 64, expert width 96: no dimension is a multiple of 128."""
    return tiny_checkpoint("mixtral")


def _padded_block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = w.shape
    bn, bk = block
    padded = torch.nn.functional.pad(w.float().abs(), (0, -cols % bk, 0, -rows % bn))
    return padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).amax(dim=(1, 3))


@pytest.mark.parametrize("shape", [(200, 300), (256, 128), (1, 5), (384, 256)])
def test_block_amax_is_the_amax_of_zero_padded_blocks(shape, monkeypatch):
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", 128 * 300)  # several row chunks per weight
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(fp8.grid_amax(w, (128, 128), "w"), _padded_block_amax(w, (128, 128)))


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_quantized_weights_are_within_fp8_rounding(scheme, scale_dtype, monkeypatch):
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", 128 * 300)
    g = torch.Generator().manual_seed(1)
    gate = torch.randn(200, 300, generator=g).to(torch.bfloat16) * torch.logspace(-3, 1, 200)[:, None].bfloat16()
    up = torch.randn(200, 300, generator=g).to(torch.bfloat16)
    gate[:130] = 0  # an all-zero block and rows
    s = SCHEMES[scheme]
    for original, q in zip((gate, up), s.quantize_group([("gate", gate), ("up", up)], scale_dtype)):
        assert q.weight.dtype == fp8.FP8_DTYPE and tuple(q.scale.shape) == s.scale_shape(original.shape)
        assert torch.equal(q.scale, q.scale.to(scale_dtype).float()), "scale must be what the reader stores"
        assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
        expanded = expand_weight_scale(q.scale[None], s.moe_spec, (1, *original.shape))[0]
        deq = q.weight.float() * expanded
        assert ((deq - original.float()).abs() <= fp8.rounding_bound(original, expanded)).all()


def test_per_tensor_scheme_shares_one_scale_between_gate_and_up():
    gate, up = torch.ones(4, 4), torch.full((4, 4), 8.0)
    qg, qu = SCHEMES["tensor"].quantize_group([("gate", gate), ("up", up)], torch.float32)
    assert qg.scale.item() == qu.scale.item() == pytest.approx(8 / 448)


def test_block_amax_names_a_tensor_with_nan():  # in the last, partial block
    w = torch.zeros(130, 130)
    w[129, 3] = float("nan")
    with pytest.raises(UserError, match="'experts.0.w1' contains NaN"):
        fp8.grid_amax(w, (128, 128), "experts.0.w1")


def test_scales_stay_normal_in_a_narrow_storage_dtype():
    scale = fp8.scale_from_amax(torch.tensor([0.0, 1e-12, 448.0]), torch.float16)
    assert scale.tolist() == [1.0, torch.finfo(torch.float16).tiny, 1.0]


def test_auto_picks_block_fp8_when_experts_fit_and_channel_otherwise(block_friendly, narrow_mixtral):
    assert make_plan(Checkpoint(block_friendly("mixtral"))).options.format == "fp8"
    assert make_plan(Checkpoint(block_friendly("mixtral"))).options.scheme == "block"
    narrow = make_plan(Checkpoint(narrow_mixtral)).options
    assert (narrow.format, narrow.scheme) == ("compressed-tensors", "channel")
    fixed = make_plan(Checkpoint(narrow_mixtral), Options(format="fp8")).options
    assert (fixed.format, fixed.scheme) == ("fp8", "tensor")


def test_a_combination_no_engine_reads_is_refused_with_the_alternative(narrow_mixtral):
    with pytest.raises(UserError, match="--format fp8 stores only tensor or block scales.*"
                                        "use --format compressed-tensors --scheme channel"):
        make_plan(Checkpoint(narrow_mixtral), Options(format="fp8", scheme="channel"))


def test_block_scheme_is_refused_when_experts_do_not_fit(narrow_mixtral):
    with pytest.raises(UserError, match=r"--scheme block does not fit this checkpoint's routed experts: in "
                                        r"'.*experts\.0\.w[123]\.weight', (96 x 64|64 x 96) is not a multiple of the "
                                        r"128 x 128 block .*; use --format compressed-tensors --scheme channel\."):
        make_plan(Checkpoint(narrow_mixtral), Options(scheme="block"))


def test_linears_that_break_blocks_stay_in_bf16_with_their_fused_siblings(block_friendly):
    plan = make_plan(Checkpoint(block_friendly("deepseek_v3")))
    kv_a = plan.decisions["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    q_a = plan.decisions["model.layers.1.self_attn.q_a_proj.weight"]
    assert not kv_a.quantize and "not a multiple of the 128 x 128 block" in kv_a.reason
    assert not q_a.quantize and q_a.reason.startswith("fused with kv_a_proj_with_mqa")
    assert plan.decisions["model.layers.1.mlp.experts.3.down_proj.weight"].quantize
    assert plan.decisions["model.layers.0.mlp.down_proj.weight"].quantize
    config = plan.quantization_config
    for listed in (config["modules_to_not_convert"], config["ignored_layers"]):
        assert {"lm_head", "model.layers.1.self_attn.kv_a_proj_with_mqa",
                "model.layers.1.self_attn.q_a_proj"} <= set(listed)


def test_block_tp_sizes_follow_expert_width():
    assert block_tp_sizes({768}, 128) == [1, 2]  # Qwen3-30B-A3B: 192 per rank at TP=4
    assert block_tp_sizes({2880}, 128) == []  # gpt-oss
    assert block_tp_sizes({2048, 1408 + 128}, 128) == [1, 2, 4]


def test_compressed_tensors_ignore_patterns_are_anchored_and_exact():
    gates = [f"model.layers.{i}.mlp.gate" for i in range(3)]
    entries = ignore_entries(["lm_head", *gates], quantized=["model.layers.0.mlp.gate_proj"])
    assert entries == ["lm_head", r"re:model\.layers\.\d+\.mlp\.gate$"]
    assert not re.match(entries[1][3:], "model.layers.0.mlp.gate_proj")
    downs = ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert ignore_entries(downs, quantized=["model.layers.2.mlp.down_proj"]) == downs


# (format, scheme) -> scale suffix, dtype and shape for a [128, 256] expert w1 of a bf16 model
WRITTEN = {
    ("fp8", "tensor"): ("weight_scale", torch.float32, ()),
    ("fp8", "block"): ("weight_scale_inv", torch.float32, (1, 2)),
    ("compressed-tensors", "tensor"): ("weight_scale", torch.bfloat16, (1,)),
    ("compressed-tensors", "channel"): ("weight_scale", torch.bfloat16, (128, 1)),
    ("compressed-tensors", "block"): ("weight_scale", torch.bfloat16, (1, 2)),
}


@pytest.mark.parametrize("fmt,scheme", list(LOADS))
def test_every_combination_writes_its_scales_and_reads_back(fmt, scheme, block_friendly, tmp_path):
    assert set(WRITTEN) == set(LOADS)
    src = block_friendly("mixtral")
    summary = quantize_checkpoint(src, tmp_path / "out", Options(format=fmt, scheme=scheme), show_progress=False)
    suffix, dtype, shape = WRITTEN[(fmt, scheme)]
    out = Checkpoint(tmp_path / "out")
    assert out.tensors[f"{EXPERT}.w1.weight"].dtype == fp8.FP8_DTYPE
    scale = out.tensors[f"{EXPERT}.w1.{suffix}"]
    assert (scale.dtype, scale.shape) == (dtype, shape)
    # compressed-tensors declares per-tensor activations under tensor weights (what vLLM's MoE method takes)
    spec = MoEQuantSpec("tensor", "tensor") if (fmt, scheme) == ("compressed-tensors", "tensor") else \
        SCHEMES[scheme].moe_spec
    assert read_quantization(out.raw_config, "config.json") == (spec, suffix)
    assert out.raw_config["quantization_config"] == summary.plan.quantization_config
    assert all(c.ok for c in check_expert_weights(src, tmp_path / "out"))


def test_inspect_shows_engines_and_tensor_parallel_sizes(block_friendly):
    result = CliRunner().invoke(app, ["inspect", str(block_friendly("mixtral"))], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert re.search(r"scheme / format\s*│\s*block / fp8", result.output)
    assert re.search(r"loads in transformers\s*│\s*yes", result.output)
    assert re.search(r"TP sizes, whole blocks\s*│\s*1\s", result.output)
    ct = CliRunner().invoke(app, ["inspect", str(block_friendly("mixtral")), "--format", "compressed-tensors",
                                  "--scheme", "block"], env={"COLUMNS": "200"})
    assert re.search(r"loads in transformers\s*│\s*no: block-scaled MoE experts", ct.output)


def test_quantize_cli_refuses_a_combination_in_one_sentence(narrow_mixtral, tmp_path):
    result = CliRunner().invoke(app, ["quantize", str(narrow_mixtral), str(tmp_path / "out"), "--format", "fp8",
                                      "--scheme", "channel"], env={"COLUMNS": "200"}, catch_exceptions=False)
    assert result.exit_code == 2  # no engine reads it whatever the checkpoint: bad usage
    assert "error: --format fp8 stores only tensor or block scales" in result.output
    assert not (tmp_path / "out").exists()


def test_block_scale_grid_of_a_partial_block_weight_is_rounded_up():
    assert SCHEMES["block"].scale_shape((576, 7168)) == (math.ceil(576 / 128), 56)


def test_fused_expert_families_resolve_to_native_per_tensor_and_refuse_the_rest(tiny_checkpoint):
    src = Checkpoint(tiny_checkpoint("dbrx"))
    options = make_plan(src).options
    assert (options.format, options.scheme) == ("fp8", "tensor")
    with pytest.raises(UserError, match="fused tensors that engines load with per-tensor scales only; "
                                        "use --format fp8 --scheme tensor"):
        make_plan(src, Options(format="compressed-tensors"))
