"""`quantize`'s calibration options (`--activations static`, `--kv-cache fp8`, `--calibration FILE` and its
sample count and length) and the `Calibration` the job runs: tokens read before anything is written, the
model run over them (run/calibration.py) once the job's pre-flight checks have passed."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from quantize_moe.console import console, stdout
from quantize_moe.plan.options import ACTIVATION_CHOICES, KV_CACHE_CHOICES, Options

Activations = Annotated[Literal[ACTIVATION_CHOICES], typer.Option(
    metavar="dynamic|static", help="dynamic: the engine scales activations at run time; static: per-tensor "
                                   "input scales measured on --calibration.")]
KvCache = Annotated[Optional[Literal[KV_CACHE_CHOICES]], typer.Option(
    metavar="fp8", help="Per-tensor k_scale / v_scale of every attention layer, measured on --calibration.")]
CalibrationFile = Annotated[Optional[Path], typer.Option(
    metavar="FILE", help="Calibration data for --activations static and --kv-cache: text or .jsonl (field "
                         "\"text\") tokenized with SRC's tokenizer, or safetensors with 'input_ids' [N, T].")]
CalibrationSamples = Annotated[Optional[int], typer.Option(
    min=1, metavar="N", help="Calibration sequences to use (default: all).")]
CalibrationLength = Annotated[int, typer.Option(min=2, metavar="T", help="Tokens per calibration sequence.")]
RoutedOnly = Annotated[bool, typer.Option(
    "--calibration-routed-only", help="Measure each expert on the tokens routed to it only, instead of on "
                                      "every token.")]


def calibration_for(options: Options, src: Path, device: str):
    """The calibration of a run with calibrated scales: its tokens read now (bad data is refused before
    anything is written), the model run over them when the job has passed its pre-flight checks."""
    from quantize_moe.plan.compatibility import check_calibrated

    check_calibrated(options)
    if not options.calibrates:
        return None
    from quantize_moe.adapters.reader import SourceReader
    from quantize_moe.run.calibration import calibrate
    from quantize_moe.run.tokens import TokenOptions, load_tokens, tokens_digest
    from quantize_moe.write.job import Calibration
    from quantize_moe.write.pipeline import parse_devices

    batches = load_tokens(Path(options.calibration), src, options.calibration_length, options.calibration_samples,
                          TokenOptions("--calibration", "--calibration-length", "--calibration-samples", strict=True))
    first_device = str(parse_devices(device)[0])  # the model runs on one device

    def measure(plan):
        console.print(f"calibrating on {sum(b.numel() for b in batches)} tokens, one layer at a time")
        return calibrate(SourceReader(plan.checkpoint), batches, first_device, options.calibration_routed_only,
                         activations=options.activations == "static", kv_cache=options.kv_cache is not None)
    return Calibration(tokens_digest(batches), measure)


def print_measured(amax) -> None:
    """The per-layer table of what calibration measured, when the run calibrated."""
    if amax is not None:
        from quantize_moe.cli.report import calibration_table

        stdout.print(calibration_table(amax))
