"""Held-out perplexity of the trained tiny Mixtral fixture in bf16 and after FP8 quantization.

    python scripts/fixture_perplexity.py [--fixtures ../shared/fixtures]

Quantizes the fixture into a temporary folder, loads the dequantized weights into
the same transformers model, and prints bf16 and FP8 perplexity and their ratio.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from quantize_moe.dequantize import dequantize_checkpoint
from quantize_moe.evaluate import heldout_perplexity
from quantize_moe.plan import Options
from quantize_moe.quantize import quantize_checkpoint


def fixture_perplexities(fixtures: Path, options: Options = Options()) -> tuple[float, float]:
    """(bf16 perplexity, perplexity with the FP8 checkpoint's dequantized weights)."""
    model_dir = fixtures / "tiny-mixtral-trained"
    data = (fixtures / "heldout-python-source.bin").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    bf16 = heldout_perplexity(model, data)
    with tempfile.TemporaryDirectory() as tmp:
        quantize_checkpoint(model_dir, Path(tmp) / "fp8", options, show_progress=False)
        dequantize_checkpoint(Path(tmp) / "fp8", Path(tmp) / "dequantized")
        dequantized = AutoModelForCausalLM.from_pretrained(Path(tmp) / "dequantized", dtype=torch.bfloat16)
    return bf16, heldout_perplexity(dequantized.eval(), data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=Path(__file__).resolve().parents[2] / "shared/fixtures")
    parser.add_argument("--experts-only", action="store_true")
    args = parser.parse_args()
    bf16, quantized = fixture_perplexities(args.fixtures, Options(experts_only=args.experts_only))
    print(f"| bf16 | fp8 per-tensor{' (experts only)' if args.experts_only else ''} | ratio |")
    print(f"| {bf16:.4f} | {quantized:.4f} | {quantized / bf16:.4f} |")


if __name__ == "__main__":
    main()
