"""Held-out perplexity of the trained tiny Mixtral fixture in bf16 and in every FP8 format and scheme.

    python scripts/fixture_perplexity.py [--fixtures ../shared/fixtures] [--experts-only] [--windows 64]

Each combination is quantized into a temporary folder and loaded by transformers'
own loader (combinations transformers cannot load are dequantized by quantize-moe
first); prints a markdown table of perplexities and their ratio to bf16.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from quantize_moe.plan.compatibility import LOADS
from quantize_moe.check.evaluate import fp8_perplexity, heldout_perplexity
from quantize_moe.plan.options import Options

MODEL = "tiny-mixtral-trained"
HELDOUT = "heldout-python-source.bin"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=Path(__file__).resolve().parents[2] / "shared/fixtures")
    parser.add_argument("--experts-only", action="store_true")
    parser.add_argument("--windows", type=int, default=64)
    args = parser.parse_args()
    src, data = args.fixtures / MODEL, (args.fixtures / HELDOUT).read_bytes()
    bf16 = heldout_perplexity(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval(), data,
                              args.windows)
    print(f"| format | scheme | loaded by | perplexity | ratio to bf16 |\n|---|---|---|---|---|\n"
          f"| bf16 | - | transformers | {bf16:.4f} | 1.0000 |")
    for fmt, scheme in LOADS:
        with tempfile.TemporaryDirectory() as tmp:
            options = Options(experts_only=args.experts_only, format=fmt, scheme=scheme)
            _, how, ppl = fp8_perplexity(src, data, options, Path(tmp), args.windows)
        print(f"| {fmt} | {scheme} | {how} | {ppl:.4f} | {ppl / bf16:.4f} |", flush=True)


if __name__ == "__main__":
    main()
