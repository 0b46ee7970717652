"""FP8 scales and codes on disk, pinned against a reference computed here from the source tensors.

Nothing from `quantize_moe.quantization` is used to build the expectation: scales are amax / 448 per
tensor (one amax shared by gate/up of an expert and by q/k/v of an attention block), per row, or per
128 x 128 block (ceil grid); codes come from torch's own float8_e4m3fn cast; both files are read with
safetensors' `safe_open`. Tests that bound the rounding error by the written scale pass for a wrong
scale; these compare scales exactly and codes as bytes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantize_moe.plan.options import Options
from quantize_moe.write.job import quantize_checkpoint

E4M3_MAX = 448.0
BLOCK = 128
# Sibling Linears that share one per-tensor scale (engines fuse them and requantize to one scale).
SHARED = ({"w1", "w3"}, {"gate_proj", "up_proj"}, {"q_proj", "k_proj", "v_proj"}, {"q_a_proj", "kv_a_proj_with_mqa"})
# (format, scheme) -> name of the scale tensor beside each weight, and its stored dtype (None: the model's)
WRITTEN = {
    ("fp8", "tensor"): ("weight_scale", torch.float32),
    ("fp8", "block"): ("weight_scale_inv", torch.float32),
    ("compressed-tensors", "tensor"): ("weight_scale", None),
    ("compressed-tensors", "channel"): ("weight_scale", None),
    ("compressed-tensors", "block"): ("weight_scale", None),
}


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def sibling_key(name: str) -> tuple[str, frozenset] | None:
    """(parent module, sibling set) for a Linear weight that shares its per-tensor scale, else None."""
    match = re.fullmatch(r"(.*)\.([^.]+)\.weight", name)
    for siblings in SHARED:
        if match and match.group(2) in siblings:
            return match.group(1), frozenset(siblings)
    return None


def cell_amax(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """amax of every cell: [1, 1] per tensor, [rows, 1] per channel, [ceil(r/128), ceil(c/128)] per block."""
    a = w.float().abs()
    if scheme == "tensor":
        return a.max().reshape(1, 1)
    if scheme == "channel":
        return a.amax(dim=1, keepdim=True)
    rows, cols = a.shape
    grid = torch.zeros(-(-rows // BLOCK), -(-cols // BLOCK))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = a[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].max()
    return grid


def reference(source: dict[str, torch.Tensor], names: list[str], scheme: str, scale_dtype: torch.dtype):
    """{name: (stored scale, codes as uint8)} for weights `names` of the source."""
    amaxes = {n: cell_amax(source[n], scheme) for n in names}
    if scheme == "tensor":
        groups: dict = {}
        for n in names:
            groups.setdefault(sibling_key(n) or n, []).append(n)
        for members in groups.values():
            shared = torch.stack([amaxes[n] for n in members]).max()
            amaxes.update({n: shared.reshape(1, 1) for n in members})
    out = {}
    for n in names:
        amax = amaxes[n]
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(scale_dtype)
        w = source[n].float()
        full = scale.float().repeat_interleave(w.shape[0] // scale.shape[0] if scheme != "block" else BLOCK, 0)
        full = full.repeat_interleave(w.shape[1] if scheme != "block" else BLOCK, 1)[:w.shape[0], :w.shape[1]]
        codes = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        out[n] = (scale, codes.view(torch.uint8))
    return out


@pytest.mark.parametrize("fmt,scheme", list(WRITTEN))
def test_written_scales_and_codes_match_an_independent_reference(fmt, scheme, block_friendly, tmp_path):
    src = block_friendly("mixtral")
    quantize_checkpoint(src, tmp_path / "out", Options(format=fmt, scheme=scheme), show_progress=False)
    source, written = read_all(src), read_all(tmp_path / "out")
    suffix, scale_dtype = WRITTEN[(fmt, scheme)]
    quantized = sorted(n for n, t in written.items() if t.dtype == torch.float8_e4m3fn)
    # Experts and all of q/k/v are quantized, so the shared-scale groups are really exercised.
    assert any(".experts.0.w1." in n for n in quantized) and any(".experts.0.w3." in n for n in quantized)
    assert {"q_proj", "k_proj", "v_proj"} <= {n.split(".")[-2] for n in quantized}
    expected = reference(source, quantized, scheme, scale_dtype or source[quantized[0]].dtype)
    for name in quantized:
        scale, codes = expected[name]
        stored = written[f"{name.removesuffix('.weight')}.{suffix}"]
        if scheme == "tensor":
            scale = scale.reshape(() if fmt == "fp8" else (1,))
        assert stored.dtype == scale.dtype and stored.shape == scale.shape, name
        assert torch.equal(stored, scale), f"{name}: scale {stored.flatten()[:4]} != {scale.flatten()[:4]}"
        mismatched = (written[name].view(torch.uint8) != codes).sum().item()
        assert mismatched == 0, f"{name}: {mismatched} of {codes.numel()} codes differ"
