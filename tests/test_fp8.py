"""FP8 arithmetic and the per-tensor scheme."""

from __future__ import annotations

import pytest
import torch

from quantize_moe.quantization import fp8
from quantize_moe.errors import UserError
from quantize_moe.quantization.schemes import PerTensorScheme


def test_quantize_round_trip_is_within_the_rounding_bound():
    w = torch.randn(300, 70, dtype=torch.bfloat16) * 0.02
    w[0, 0] = 0.5  # a single outlier sets the scale: most values land in the subnormal range
    scale = fp8.scale_from_amax(fp8.amax(w, "w"))
    q = fp8.quantize(w, scale)
    assert q.dtype == torch.float8_e4m3fn
    assert fp8.dequantize(q, scale)[0, 0] == pytest.approx(0.5)
    error = (fp8.dequantize(q, scale) - w.float()).abs()
    assert (error <= fp8.rounding_bound(w, scale)).all()
    assert (error > 0).any()  # really rounded


def test_chunked_quantize_matches_one_shot(monkeypatch):
    w = torch.randn(257, 33) * 3
    scale = fp8.scale_from_amax(fp8.amax(w, "w"))
    one_shot = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", 100)  # several rows per chunk, many chunks
    assert torch.equal(fp8.quantize(w, scale).view(torch.uint8), one_shot.view(torch.uint8))


def test_per_row_scales():
    w = torch.randn(64, 16) * torch.logspace(-3, 1, 64)[:, None]
    scale = fp8.scale_from_amax(fp8.row_amax(w, "w"))
    q = fp8.quantize(w, scale)
    assert q.float().abs().amax(dim=1).eq(448).all()
    assert ((fp8.dequantize(q, scale) - w).abs() <= fp8.rounding_bound(w, scale[:, None])).all()


def test_all_zero_weight_gets_a_safe_scale():
    (q,) = PerTensorScheme().quantize_group([("zero", torch.zeros(8, 8, dtype=torch.bfloat16))])
    assert q.scale.item() == 1.0 and torch.isfinite(q.scale)
    assert (q.weight.float() == 0).all()


def test_gate_and_up_share_the_larger_scale():
    gate = torch.randn(16, 8) * 0.01
    up = torch.randn(16, 8) * 4
    qg, qu = PerTensorScheme().quantize_group([("gate", gate), ("up", up)])
    assert qg.scale.item() == qu.scale.item() == pytest.approx(up.abs().max().item() / 448)
    assert qg.scale.data_ptr() != qu.scale.data_ptr()  # distinct tensors: safetensors refuses shared memory


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_is_an_error_naming_the_tensor(bad):
    w = torch.randn(4, 4)
    w[2, 3] = bad
    with pytest.raises(UserError, match="'layers.3.experts.1.w1.weight' contains NaN or Inf"):
        PerTensorScheme().quantize_group([("layers.3.experts.1.w1.weight", w)])
    with pytest.raises(UserError, match="contains NaN or Inf"):
        fp8.row_amax(w, "w")


def test_quantize_never_writes_its_input():
    """A float32 source must not be scaled in place (it may be a memory-mapped checkpoint)."""
    w = torch.randn(40, 24)
    before = w.clone()
    fp8.quantize(w, fp8.scale_from_amax(fp8.amax(w, "w")))
    assert torch.equal(w, before)
