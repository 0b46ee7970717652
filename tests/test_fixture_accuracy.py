"""Held-out perplexity of the trained tiny Mixtral fixture stays put after FP8 quantization."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fixture_perplexity.py"


@pytest.mark.slow
def test_fp8_perplexity_matches_bf16(shared_fixtures):
    spec = importlib.util.spec_from_file_location("fixture_perplexity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bf16, quantized = module.fixture_perplexities(shared_fixtures)
    assert bf16 == pytest.approx(3.233, rel=0.005)  # the fixture's documented bf16 perplexity
    assert quantized / bf16 < 1.005
