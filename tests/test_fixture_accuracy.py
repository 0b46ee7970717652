"""Held-out perplexity of the trained tiny Mixtral fixture stays within 0.2% of bf16 in every FP8 format
and scheme, through transformers' own loader (a quick version of scripts/fixture_perplexity.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantize_moe.plan.compatibility import LOADS
from quantize_moe.check.evaluate import fp8_perplexity, heldout_perplexity
from quantize_moe.plan.options import Options

WINDOWS = 8  # of the script's 64: the ratio is paired over the same windows, so it is stable


@pytest.mark.slow
def test_every_format_and_scheme_keeps_perplexity_within_0_2_percent(shared_fixtures, tmp_path):
    src, data = shared_fixtures / "tiny-mixtral-trained", (shared_fixtures / "heldout-python-source.bin").read_bytes()
    bf16 = heldout_perplexity(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval(), data, WINDOWS)
    for fmt, scheme in LOADS:
        options, _, ppl = fp8_perplexity(src, data, Options(format=fmt, scheme=scheme), tmp_path / f"{fmt}-{scheme}",
                                         WINDOWS)
        assert (options.format, options.scheme) == (fmt, scheme)
        assert ppl / bf16 < 1.002, (fmt, scheme, ppl / bf16)
