"""The accuracy target of static calibration (issue 17) on the trained fixture: calibrated on windows from
the first half of the held-out bytes, evaluated on disjoint windows from the second half, through the
commands a user runs (`quantize --activations static --calibration`, `evaluate --json`). Skips without
../shared/fixtures. `pytest -s` prints the numbers docs/performance.md records."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers.utils import logging as transformers_logging
from typer.testing import CliRunner

from quantize_moe.cli.app import app

WINDOWS, LENGTH = 32, 512
# Static per-tensor activations: the target (measured 1.0011-1.0013). An FP8 KV cache on top
# rounds every key and value too and measured 1.0029-1.0032 (docs/performance.md): the same bound holds
# with a third of it to spare, while k_scale off by 100x is far past it (tests/test_kv_cache.py).
BOUNDS = {(): 1.005, ("--kv-cache", "fp8"): 1.005}
runner = CliRunner()


def _windows(tokens: torch.Tensor, start: int, stop: int, length: int, seed: int) -> torch.Tensor:
    """`WINDOWS` random windows of `length` tokens lying inside tokens[start:stop]."""
    offsets = torch.randint(start, stop - length, (WINDOWS,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([tokens[o:o + length] for o in offsets.tolist()])


@pytest.fixture
def held_out(shared_fixtures, tmp_path):
    """Calibration windows from the first half of the held-out file and evaluation windows (one token
    longer: the targets) from the second half, as `input_ids` files."""
    transformers_logging.set_verbosity_error()
    data = (shared_fixtures / "heldout-python-source.bin").read_bytes()
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    root, half = tmp_path, len(tokens) // 2
    save_file({"input_ids": _windows(tokens, 0, half, LENGTH, 1)}, root / "calibration.safetensors")
    save_file({"input_ids": _windows(tokens, half, len(tokens), LENGTH + 1, 2)}, root / "eval.safetensors")
    return shared_fixtures / "tiny-mixtral-trained", root


@pytest.mark.slow
@pytest.mark.parametrize("kv", list(BOUNDS), ids=["static", "static-kv-fp8"])
@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_static_per_tensor_keeps_held_out_perplexity(held_out, fmt, kv):
    src, root = held_out
    dst = root / "dst"
    result = runner.invoke(app, ["quantize", str(src), str(dst), "--no-progress", "--format", fmt, "--scheme",
                                 "tensor", "--activations", "static", *kv, "--calibration",
                                 str(root / "calibration.safetensors"), "--calibration-length", str(LENGTH)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["evaluate", str(src), str(dst), "--data", str(root / "eval.safetensors"), "--json"])
    assert result.exit_code in (0, 3), result.output
    report = json.loads(result.stdout)
    print(f"\n{fmt} static{' + kv fp8' if kv else ''}: bf16 {report['src_perplexity']:.4f} fp8 "
          f"{report['dst_perplexity']:.4f} ratio {report['perplexity_ratio']:.5f} KL {report['mean_kl']:.5f} "
          f"top-1 {report['top1_agreement']:.4f}")
    assert report["tokens"] == WINDOWS * LENGTH
    assert report["perplexity_ratio"] <= BOUNDS[kv], report
