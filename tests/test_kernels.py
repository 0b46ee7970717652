"""CPU tests of the fused-MoE reference, the align step, the configs, the kernels
under the Triton interpreter (in a subprocess) and the wheel layout."""

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe_inputs import MODES, quantized, random_problem, relative_error, with_static_scales
from quantize_moe.kernels.configs import (
    CONFIG_KEYS, config_file_name, default_config, get_config, load_tuned_table, per_gemm,
)
from quantize_moe.quantization.spec import MoEQuantSpec
from quantize_moe.moe.reference import FP8_MAX, dequantize_activation, fused_experts_reference, quantize_activation

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))


def _dense_moe(x, w13, w2, topk_weights, topk_ids):
    """The layer written per (token, slot) with gathered weights: no expert grouping."""
    inter = w2.shape[2]
    gate_up = torch.einsum("th,tknh->tkn", x, w13[topk_ids.long()])
    act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    out = torch.einsum("tki,tkhi->tkh", act, w2[topk_ids.long()])
    return (out * topk_weights.unsqueeze(-1)).sum(dim=1)


@pytest.mark.parametrize("shape", [(1, 16, 8, 4, 1), (9, 32, 24, 8, 3)])
def test_reference_matches_dense_computation(shape):
    p = random_problem(*shape, dtype=torch.float64)
    ref = fused_experts_reference(*p.args(), compute_dtype=torch.float64)
    torch.testing.assert_close(ref, _dense_moe(*p.args()), rtol=1e-12, atol=1e-12)


def _dequantize_independently(w, scale, quant):
    """Weight dequantization written out per scheme; blocks as an explicit loop."""
    if quant.weight == "tensor":
        return w.double() * scale.double()[:, None, None]
    if quant.weight == "channel":
        return w.double() * scale.double()[:, :, None]
    block_n, block_k = quant.block_shape
    out = w.double().clone()
    for n0 in range(0, w.shape[1], block_n):
        for k0 in range(0, w.shape[2], block_k):
            out[:, n0:n0 + block_n, k0:k0 + block_k] *= scale[:, n0 // block_n, k0 // block_k].double()[:, None, None]
    return out


@pytest.mark.parametrize("mode", MODES)
def test_fp8_reference_without_activation_quantization(mode):
    """Weights dequantized independently, activations exact: the reference is the dense layer."""
    p = quantized(random_problem(6, 200, 136, 4, 2), MODES[mode])
    w13 = _dequantize_independently(p.w13, p.w13_scale, p.quant)
    w2 = _dequantize_independently(p.w2, p.w2_scale, p.quant)
    ref = fused_experts_reference(*p.args(), **p.kwargs(), compute_dtype=torch.float64, quantize_activations=False)
    expected = _dense_moe(p.hidden_states.double(), w13, w2, p.topk_weights.double(), p.topk_ids)
    torch.testing.assert_close(ref, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", MODES)
def test_activation_quantization_costs_fp8_accuracy_only(mode):
    """Quantized activations change the output by FP8 rounding: a few percent, not more, not zero."""
    p = quantized(random_problem(16, 256, 128, 4, 2), MODES[mode])
    exact = fused_experts_reference(*p.args(), **p.kwargs(), compute_dtype=torch.float64, quantize_activations=False)
    fake = fused_experts_reference(*p.args(), **p.kwargs(), compute_dtype=torch.float64)
    assert 1e-3 < relative_error(fake, exact) < 0.08


@pytest.mark.parametrize("scheme", ["token", "tensor", "group"])
def test_activation_quantization_round_trip(scheme):
    quant = MoEQuantSpec("block", "group", (128, 128)) if scheme == "group" else MoEQuantSpec("tensor", scheme)
    x = torch.randn(5, 300) * torch.logspace(-2, 2, 5).unsqueeze(1)
    x[2] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_activation(x, quant)
    expected_shape = {"token": (5, 1), "tensor": (1,), "group": (5, 3)}[scheme]
    assert q.dtype == torch.float8_e4m3fn and tuple(scale.shape) == expected_shape
    assert q.float().abs().max() == FP8_MAX  # the largest magnitude maps to the top of the range
    assert torch.isfinite(q.float()).all()
    back = dequantize_activation(q, scale, quant, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 per element above the subnormals.
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + scale.max() * 2 ** -9).all()


def test_config_file_names():
    name = config_file_name(256, 4096, "NVIDIA H200", MoEQuantSpec("block", "group", (128, 128)))
    assert name == "E=256,N=4096,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    assert config_file_name(8, 28672, "NVIDIA H200", MoEQuantSpec()) == "E=8,N=28672,device_name=NVIDIA_H200.json"


def test_default_config_block_k_divides_quantization_group():
    quant = MoEQuantSpec("block", "group", (128, 128))
    for tokens in (1, 64, 1024, 16384):
        config = default_config(tokens, 128, 8, quant)
        assert 128 % config["BLOCK_SIZE_K"] == 0


def test_tuned_tables_are_complete_and_nearest_key_wins(monkeypatch):
    """Every shipped table has all launch keys for both GEMMs; get_config picks the nearest token count."""
    for name in os.listdir(REPO / "configs"):
        if name.endswith(".json"):
            table = load_tuned_table(name)
            assert table and all(set(c) >= set(CONFIG_KEYS) for pair in table.values() for c in pair), name
    table = {1: ({"BLOCK_SIZE_M": 16}, {"BLOCK_SIZE_M": 16}), 64: ({"BLOCK_SIZE_M": 32}, {"BLOCK_SIZE_M": 32}),
             1024: ({"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 64}, {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256})}
    monkeypatch.setattr("quantize_moe.kernels.configs.load_tuned_table", lambda name: table)
    assert get_config(40, 8, 128, 2, MoEQuantSpec())[0]["BLOCK_SIZE_M"] == 32
    gemm1, gemm2 = get_config(700, 8, 128, 2, MoEQuantSpec())
    assert (gemm1["BLOCK_SIZE_N"], gemm2["BLOCK_SIZE_N"]) == (64, 256)


def test_untuned_shapes_get_the_heuristic_for_both_gemms():
    gemm1, gemm2 = get_config(64, 3, 100, 2, MoEQuantSpec())
    assert gemm1 == gemm2 == default_config(64, 3, 2, MoEQuantSpec())


def test_table_entries_in_either_format():
    """vLLM's one config for both GEMMs, or one per GEMM; a BLOCK_SIZE_M they do not share is refused."""
    flat = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64)
    assert per_gemm(flat) == (flat, flat)
    split = dict(flat, BLOCK_SIZE_N=32, SPLIT_K=4)
    assert per_gemm({"gemm1": flat, "gemm2": split}) == (flat, split)
    with pytest.raises(ValueError, match="BLOCK_SIZE_M"):
        per_gemm({"gemm1": flat, "gemm2": dict(split, BLOCK_SIZE_M=32)})


@pytest.mark.parametrize("tokens", [1, 4, 16, 64, 256, 1024, 4096])
@pytest.mark.parametrize("shape_key", ["mixtral", "qwen3", "deepseek"])
def test_tuner_search_space(shape_key, tokens):
    """Every candidate can launch: block-mode BLOCK_K divides the group, the pipeline fits shared
    memory, split-K only with the smallest M tile; decode sizes get small M tiles, large ones large."""
    from moe_problems import MODES, SHAPES
    from tune_moe import SHARED_MEMORY, search_space

    shape = SHAPES[shape_key]
    for mode, quant in MODES.items():
        space = search_space(shape, tokens, quant)
        assert len(space) == len({json.dumps(c, sort_keys=True) for c in space}) > 10, mode
        for c in space:
            assert set(c) >= set(CONFIG_KEYS)
            assert quant.weight != "block" or 128 % c["BLOCK_SIZE_K"] == 0
            stage_bytes = (c["BLOCK_SIZE_M"] + c["BLOCK_SIZE_N"]) * c["BLOCK_SIZE_K"] * (1 if quant.is_fp8 else 2)
            assert c["num_stages"] * stage_bytes <= SHARED_MEMORY
            assert c["SPLIT_K"] == 1 or c["BLOCK_SIZE_M"] == 16
        block_ms = {c["BLOCK_SIZE_M"] for c in space}
        rows = tokens * shape.top_k / shape.experts
        rescales = {c.get("RESCALE_ACC") for c in space}
        assert rescales == ({False, True} if quant.weight == "block" and rows > 16 else {None}), mode
        assert {c["PERSISTENT"] for c in space} == ({False, True} if rows > 16 else {False}), mode
        assert (min(block_ms) == 16) == (rows <= 64) and (max(block_ms) == 128) == (rows >= 64)


def test_tuner_pairs_the_fastest_configs_that_share_block_m():
    from tune_moe import FINALISTS, finalist_pairs

    def config(m, n):
        return dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n)

    gemm1 = [(t, config(m, n)) for t, m, n in [(5, 16, 32), (1, 16, 64), (3, 16, 128), (2, 64, 64), (9, 128, 64)]]
    gemm2 = [(t, config(m, n)) for t, m, n in [(4, 16, 16), (1, 64, 256), (2, 64, 128), (3, 64, 64)]]
    pairs = finalist_pairs(gemm1, gemm2)
    assert FINALISTS == 2 and all(c1["BLOCK_SIZE_M"] == c2["BLOCK_SIZE_M"] for c1, c2 in pairs)
    assert pairs == [(config(16, 64), config(16, 16)), (config(16, 128), config(16, 16)),
                     (config(64, 64), config(64, 256)), (config(64, 64), config(64, 128))]
    # The table's current entry runs too, once.
    incumbent = (config(128, 64), config(128, 64))
    assert finalist_pairs(gemm1, gemm2, incumbent) == pairs + [incumbent]
    assert finalist_pairs(gemm1, gemm2, pairs[2]) == pairs


def test_tuner_replaces_only_the_rows_it_tuned(tmp_path):
    from tune_moe import merged_table

    path = tmp_path / "table.json"
    assert merged_table(path, {"64": "new"}) == {"64": "new"}
    path.write_text(json.dumps({"1": "old", "64": "old", "4096": "old"}))
    merged = merged_table(path, {"64": "new", "256": "new"})
    assert merged == {"1": "old", "64": "new", "256": "new", "4096": "old"}
    assert list(merged) == ["1", "64", "256", "4096"]


def test_benchmark_reports_the_median_pass_and_the_spread():
    from benchmark_moe import median_rows

    def row(tokens, gemms, layer):
        return dict(shape="Mixtral", mode="bf16", tokens=tokens, gemms_us=gemms, layer_us=layer)

    passes = [[row(1, 10.0, 20.0), row(64, 100.0, 110.0)], [row(1, 12.0, 21.0), row(64, 90.0, 100.0)],
              [row(1, 11.0, 25.0), row(64, 95.0, 120.0)]]
    short, long = median_rows(passes)
    assert (short["tokens"], short["gemms_us"], short["layer_us"], short["passes"]) == (1, 11.0, 21.0, 3)
    assert short["spread"] == 2.0 / 11.0 and long["gemms_us"] == 95.0 and long["spread"] == 10.0 / 95.0


def test_kernels_under_triton_interpreter():
    """The Triton kernels on CPU: TRITON_INTERPRET is read when kernels are decorated, so a fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/interpreted_kernels.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


@pytest.mark.slow
def test_wheel_ships_kernels_inside_quantize_moe(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "-w", str(tmp_path), "--no-deps", "--no-build-isolation", "-q"],
        check=True, capture_output=True, cwd=tmp_path, timeout=300,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "quantize_moe/kernels/fused_moe.py" in names and "quantize_moe/kernels/__init__.py" in names
    assert not any(name.startswith(("kernels/", "configs/")) for name in names)
    shipped_tables = {n.split("/")[-1] for n in names if n.startswith("quantize_moe/configs/") and n.endswith(".json")}
    assert shipped_tables == {n for n in os.listdir(REPO / "configs") if n.endswith(".json")}


def test_static_activations_with_calibrated_scales_are_the_dynamic_per_tensor_layer():
    """Static scales measured on the very tokens (amax / 448) give the dynamic per-tensor layer; scales
    0.8 as large saturate the largest inputs and cost a little more; 1e-5 (a broken calibration) destroys it."""
    problem = random_problem(16, 256, 128, 4, 2)
    dynamic = quantized(problem, MODES["fp8-tensor-tensor"])
    expected = fused_experts_reference(*dynamic.args(), **dynamic.kwargs())
    exact = fused_experts_reference(*dynamic.args(), **dynamic.kwargs(), quantize_activations=False)
    static = with_static_scales(problem)
    assert relative_error(fused_experts_reference(*static.args(), **static.kwargs()), expected) < 1e-3
    tight = with_static_scales(problem, headroom=0.8)
    tight_error = relative_error(fused_experts_reference(*tight.args(), **tight.kwargs()), exact)
    assert relative_error(expected, exact) < tight_error < 0.15
    broken = replace(static, a13_scale=torch.tensor([1e-5]), a2_scale=torch.tensor([1e-5]))
    assert relative_error(fused_experts_reference(*broken.args(), **broken.kwargs()), exact) > 0.5
    with pytest.raises(ValueError, match="input scale"):
        fused_experts_reference(*static.args(), **dict(static.kwargs(), a13_scale=None))
