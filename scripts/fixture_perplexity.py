"""Held-out perplexity of the trained tiny Mixtral fixture in bf16 and in every FP8 format and scheme.

    python scripts/fixture_perplexity.py [--fixtures ../shared/fixtures] [--experts-only] [--windows 64]

Each combination is quantized into a temporary folder and both models are run by `evaluate`'s layer-streamed
executor (transformers' own modules, FP8 dequantized) over the same byte windows; prints a markdown table of
perplexities and their ratio to bf16.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from quantize_moe.check.streamed_eval import EvalThresholds, EvalReport, evaluate
from quantize_moe.plan.compatibility import LOADS
from quantize_moe.plan.options import Options
from quantize_moe.write.job import quantize_checkpoint

MODEL = "tiny-mixtral-trained"
HELDOUT = "heldout-python-source.bin"


def heldout_windows(data: bytes, windows: int = 64, length: int = 512, seed: int = 1) -> list[torch.Tensor]:
    """`windows` random windows of `length` + 1 bytes (token id = byte), `length` predictions each: the
    offsets the fixture's README states its bf16 perplexity for."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    offsets = torch.randint(0, len(tokens) - length - 1, (windows,), generator=torch.Generator().manual_seed(seed))
    return [tokens[offset:offset + length + 1][None] for offset in offsets.tolist()]


def fp8_against_bf16(src: Path, batches: list[torch.Tensor], options: Options, workdir: Path
                     ) -> tuple[Options, EvalReport]:
    """Quantize `src` into `workdir` and evaluate the result against it; returns the resolved options."""
    options = quantize_checkpoint(src, workdir / "fp8", options, show_progress=False).plan.options
    return options, evaluate(src, workdir / "fp8", batches, thresholds=EvalThresholds())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=Path(__file__).resolve().parents[2] / "shared/fixtures")
    parser.add_argument("--experts-only", action="store_true")
    parser.add_argument("--windows", type=int, default=64)
    args = parser.parse_args()
    src = args.fixtures / MODEL
    batches = heldout_windows((args.fixtures / HELDOUT).read_bytes(), args.windows)
    print("| format | scheme | perplexity bf16 | perplexity FP8 | ratio | mean KL | top-1 |\n|---|---|---|---|---|---|---|")
    for fmt, scheme in LOADS:
        with tempfile.TemporaryDirectory() as tmp:
            options = Options(experts_only=args.experts_only, format=fmt, scheme=scheme)
            _, r = fp8_against_bf16(src, batches, options, Path(tmp))
        print(f"| {fmt} | {scheme} | {r.src_perplexity:.4f} | {r.dst_perplexity:.4f} | {r.perplexity_ratio:.4f} "
              f"| {r.mean_kl:.2e} | {r.top1_agreement:.4f} |", flush=True)


if __name__ == "__main__":
    main()
