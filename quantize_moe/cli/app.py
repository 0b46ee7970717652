"""The `quantize-moe` command line.

Torch, transformers and the stages that need them are imported inside the commands, so `--help`
and a mistyped option answer at once instead of after seconds of imports."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from quantize_moe import __version__
from quantize_moe.check.thresholds import Thresholds
from quantize_moe.cli.usage import Command, Group, JsonReportCommand
from quantize_moe.console import console, count_progress, human_bytes, stdout
from quantize_moe.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_USAGE, UsageError, UserError
from quantize_moe.cli import calibration as calibrated
from quantize_moe.plan.options import FORMAT_CHOICES, GPU_WORKERS_PER_DEVICE, SCHEME_CHOICES, Options

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False, cls=Group)
command = functools.partial(app.command, cls=Command)


def _print_version(asked: bool) -> None:
    if asked:
        print(f"quantize-moe {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                               help="Print the version and exit.")] = False) -> None:
    """Quantize Hugging Face Mixture-of-Experts checkpoints to FP8 and prove them correct.

    Exit codes: 0 done, 1 bad input, 2 bad usage (including an option value that is not one of its
    choices), 3 a check or threshold failed."""


def user_errors(function):
    """Report a UserError, or a failing file system (full disk, no permission), as one red sentence
    without a traceback: exit 2 for a UsageError, 1 for the rest."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        code = EXIT_BAD_INPUT
        try:
            return function(*args, **kwargs)
        except UserError as e:
            message = str(e)
            code = EXIT_USAGE if isinstance(e, UsageError) else EXIT_BAD_INPUT
        except OSError as e:
            where = f"'{e.filename}': " if e.filename else ""
            message = (f"{where}{e.strerror or e}; fix this and run the command again "
                       "(quantize continues where it stopped with --resume).")
        # soft_wrap: the terminal wraps the line, so paths in it are never broken for copying
        console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
        raise typer.Exit(code) from None
    return run


def _print_auto_choice(options: Options, plan) -> None:
    from quantize_moe.plan.compatibility import explain_auto

    if line := explain_auto(options, plan.options, plan.written_experts, plan.fused_family, plan.family.name):
        stdout.print(line, highlight=False, soft_wrap=True)


def _shard_size(value: str) -> int:
    from transformers.utils.hub import convert_file_size_to_int

    try:
        return convert_file_size_to_int(value)
    except ValueError:
        raise UsageError(f"--max-shard-size '{value}' is not a size; write it like 5GB, 500MB or 1000000.") \
            from None


ExpertsOnly = Annotated[bool, typer.Option("--experts-only", help="Quantize the routed and shared experts only.")]
MaxShardSize = Annotated[str, typer.Option(metavar="SIZE", help="Largest output shard, e.g. 5GB or 500MB.")]
AllowPickle = Annotated[bool, typer.Option(
    "--allow-pickle", help="Read a checkpoint that has only pickle weights (.bin), weights-only: pickle "
                           "objects that would run code are refused.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace the checkpoint in a non-empty DST.")]
Private = Annotated[bool, typer.Option("--private",
                                       help="Create the Hub repo as private (when it does not exist yet).")]
Adapter = Annotated[Optional[str], typer.Option(
    metavar="generic", help="Read an unknown model_type through the generic per-expert adapter (see `inspect`).")]
STREAM_SCRATCH = ".quantize-moe-download"  # hidden in DST: never copied, uploaded or taken for output
Scheme = Annotated[Literal[SCHEME_CHOICES], typer.Option(
    "--scheme", metavar="SCHEME", help="Weight scales: tensor, channel (one per output row), block (128x128), or auto: the "
                           "choice that loads in the most engines.")]
Format = Annotated[Literal[FORMAT_CHOICES], typer.Option(
    "--format", metavar="FORMAT", help="On-disk format: fp8 (vLLM/SGLang native; block scales also transformers), "
                                       "compressed-tensors, or auto.")]
Wide = Annotated[bool, typer.Option("--wide", help="Show every column of the tables (they fit 80 columns without).")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout, and nothing else.")]
JsonOut = Annotated[Optional[Path], typer.Option("--json-out", metavar="PATH",
                                                 help="Also write the report as JSON here.")]


@command()
@user_errors
def quantize(
    src: Annotated[str, typer.Argument(help="Checkpoint folder (safetensors), or Hub repo id org/name or org/name@revision.")],
    dst: Annotated[Path, typer.Argument(help="Output folder for the FP8 checkpoint.")],
    experts_only: ExpertsOnly = False,
    scheme: Scheme = "auto",
    format_: Format = "auto",
    max_shard_size: MaxShardSize = "5GB",
    overwrite: Overwrite = False,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue an interrupted run in DST: shards its manifest lists as finished (and that "
                         "still match their hashes) are kept, the rest is written again.")] = False,
    allow_pickle: AllowPickle = False,
    requantize: Annotated[bool, typer.Option(
        "--requantize", help="Quantize a SRC that is already FP8 into another scheme or format: its weights are "
                             "rounded twice (a warning and the model card say so).")] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    stream: Annotated[bool, typer.Option("--stream", help="Hub SRC: download, quantize and delete shards one "
                                                         "by one instead of caching the whole model.")] = False,
    push_to_hub: Annotated[str | None, typer.Option(metavar="ORG/NAME",
                                                    help="Then upload DST to this Hub repo.")] = None,
    private: Private = False,
    adapter: Adapter = None,
    device: Annotated[str, typer.Option("--device", "--devices", metavar="DEVICE",
                                        help="Where to quantize: cpu, cuda, or several GPUs as cuda:0,cuda:1."
                                        )] = "cpu",
    workers: Annotated[int | None, typer.Option(
        min=1, metavar="N", help="Work items in flight at once, spread over the devices (default: one per core "
                                 f"on cpu, {GPU_WORKERS_PER_DEVICE} per GPU).")] = None,
    wide: Wide = False,
    activations: calibrated.Activations = "dynamic",
    kv_cache: calibrated.KvCache = None,
    calibration: calibrated.CalibrationFile = None,
    calibration_samples: calibrated.CalibrationSamples = None,
    calibration_length: calibrated.CalibrationLength = 512,
    calibration_routed_only: calibrated.RoutedOnly = False,
) -> None:
    """Write an FP8 copy of SRC into DST.

    Weights and scales, config.json with quantization_config, a manifest of every file's size and
    digest, a model card, and every other file of SRC unchanged."""
    from quantize_moe.source.hub import open_source
    from quantize_moe.publish.model_card import record_run, write_card
    from quantize_moe.cli.report import decisions_table, run_table
    from quantize_moe.write.job import quantize_checkpoint

    options = Options(experts_only=experts_only, scheme=scheme, format=format_,
                      max_shard_size=_shard_size(max_shard_size), adapter=adapter, requantize=requantize,
                      activations=activations, kv_cache=kv_cache, calibration=calibration and str(calibration),
                      calibration_samples=calibration_samples, calibration_length=calibration_length,
                      calibration_routed_only=calibration_routed_only)
    with open_source(src, stream=stream, scratch=dst / STREAM_SCRATCH, allow_pickle=allow_pickle) as checkpoint:
        summary = quantize_checkpoint(checkpoint, dst, options, overwrite=overwrite, resume=resume,
                                      show_progress=progress, device=device, workers=workers,
                                      calibration=calibrated.calibration_for(options, checkpoint.folder, device))
        record_run(dst, checkpoint, src, summary.plan.options, summary.activation_amax)
    write_card(dst, push_to_hub)
    stdout.print(decisions_table(summary.plan, wide))
    calibrated.print_measured(summary.activation_amax)
    stdout.print(run_table(summary.plan, summary.seconds, summary.copied_files))
    _print_auto_choice(options, summary.plan)
    stdout.print(f"[green]wrote[/] {dst}")
    if push_to_hub:
        _upload(dst, push_to_hub, private)


@command()
@user_errors
def upload(
    dst: Annotated[Path, typer.Argument(help="Folder written by `quantize-moe quantize`.")],
    repo_id: Annotated[str, typer.Argument(help="Hub model repo to upload to (org/name); created if missing.")],
    private: Private = False,
) -> None:
    """Upload DST to the Hub with a generated model card.

    Re-run to resume an interrupted upload. Uses HF_TOKEN or the token of `hf auth login`."""
    _upload(dst, repo_id, private)


def _upload(dst: Path, repo_id: str, private: bool) -> None:
    from quantize_moe.publish.upload import upload as upload_folder

    stdout.print(f"[green]uploaded[/] {upload_folder(dst, repo_id, private=private)}")


@command()
@user_errors
def verify(
    dst: Annotated[Path, typer.Argument(help="Quantized checkpoint folder to check.")],
    against: Annotated[str | None, typer.Option(
        metavar="SRC", help="Source checkpoint (folder or Hub repo id): also check shapes and numerics "
                            "against it.")] = None,
    json_output: JsonFlag = False,
    json_out: JsonOut = None,
    adapter: Adapter = None,
) -> None:
    """Check DST for CI (exit 3 when a check fails).

    Structure, metadata, scales, shared gate/up scales, coverage, integrity and, with --against,
    numerics."""
    from quantize_moe.check.integrity import IntegrityCheck

    with IntegrityCheck(dst) as integrity:  # first: DST hashes on every core while torch is imported
        from quantize_moe.source.hub import open_source
        from quantize_moe.check.verify import verify as verify_checkpoint
        from quantize_moe.cli.report import verify_table

        report = verify_checkpoint(dst, open_source(against) if against else None, adapter, integrity)
    _emit(report.to_json(), json_output, json_out, lambda: verify_table(report))
    if not json_output:
        stdout.print("[green]all checks passed[/]" if report.ok else "[red]verification failed[/]")
    raise typer.Exit(report.exit_code)


@command()
@user_errors
def inspect(
    src: Annotated[str, typer.Argument(help="Checkpoint folder, or Hub repo id org/name or org/name@revision.")],
    experts_only: ExpertsOnly = False,
    scheme: Scheme = "auto",
    format_: Format = "auto",
    max_shard_size: MaxShardSize = "5GB",
    allow_pickle: AllowPickle = False,
    adapter: Adapter = None,
    wide: Wide = False,
) -> None:
    """Describe SRC and what quantize would do with it (metadata only).

    Family, MoE layers, experts, what would be quantized and what stays, sizes, and which engines load
    the result. From the Hub it reads small files and shard headers, no shards. An unknown model_type
    is described as the generic adapter would read it."""
    from quantize_moe.adapters import is_known
    from quantize_moe.cli.report import decisions_table, overview_table
    from quantize_moe.plan.plan import make_plan
    from quantize_moe.source.hub import open_source

    checkpoint = open_source(src, stream=True, allow_pickle=allow_pickle)
    shown = adapter or (None if is_known(checkpoint.raw_config) else "generic")
    options = Options(experts_only=experts_only, scheme=scheme, format=format_,
                      max_shard_size=_shard_size(max_shard_size), adapter=shown)
    plan = make_plan(checkpoint, options)
    stdout.print(overview_table(plan))
    stdout.print(decisions_table(plan, wide))
    _print_auto_choice(options, plan)
    if shown and not adapter:
        stdout.print(f"[yellow]model_type '{checkpoint.raw_config.get('model_type')}' is not a known family: this "
                     "is what the generic adapter would do; quantize, validate and verify use it only with "
                     "--adapter generic.[/]")


@command()
@user_errors
def dequantize(
    src: Annotated[Path, typer.Argument(help="FP8 checkpoint folder (ours, AutoFP8, llm-compressor, block FP8).")],
    dst: Annotated[Path, typer.Argument(help="Output folder for the bf16 checkpoint.")],
    overwrite: Overwrite = False,
    device: Annotated[str, typer.Option("--device", metavar="DEVICE",
                                        help="auto (a GPU when torch sees one), cuda, cuda:N or cpu.")] = "auto",
) -> None:
    """Write a bf16 copy of an FP8 checkpoint.

    Weights times their scales, without scale tensors or quantization_config."""
    from quantize_moe.write.dequantize import dequantize_checkpoint

    tensors, size, shards = dequantize_checkpoint(src, dst, overwrite=overwrite, device=device)
    stdout.print(f"[green]wrote[/] {tensors} tensors in bf16 ({human_bytes(size)}, {shards} shard(s)) to {dst}",
                 highlight=False)


@command()
@user_errors
def demo(
    family: Annotated[str, typer.Option(metavar="MODEL_TYPE",
                                        help="model_type of the tiny checkpoint to build.")] = "mixtral",
    wide: Wide = False,
) -> None:
    """Build, quantize and check a tiny checkpoint of a real family.

    Runs offline on a CPU and prints the report."""
    from quantize_moe.adapters import adapter_for
    from quantize_moe.check.validate import validate as run_validation
    from quantize_moe.check.weights import check_expert_weights
    from quantize_moe.cli.report import decisions_table, overview_table, run_table, validation_table, weight_check_table
    from quantize_moe.source.tiny import TINY_CONFIGS, build_tiny_checkpoint
    from quantize_moe.write.job import quantize_checkpoint

    # gpt-oss: `quantize` refuses it (no engine loads its fused experts in FP8)
    choices = [t for t in TINY_CONFIGS if not adapter_for({"model_type": t}).fp8_refusal]
    if family not in choices:
        raise UsageError(f"--family {family} has no demo checkpoint; choose one of {', '.join(choices)}.")
    with tempfile.TemporaryDirectory(prefix="quantize-moe-demo-") as tmp:
        src, dst = Path(tmp) / "bf16", Path(tmp) / "fp8"
        console.print(f"building a tiny {family} checkpoint with transformers in {src}")
        build_tiny_checkpoint(family, src, max_shard_size="200KB")
        summary = quantize_checkpoint(src, dst, Options(max_shard_size=200_000))
        stdout.print(overview_table(summary.plan))
        stdout.print(decisions_table(summary.plan, wide))
        stdout.print(run_table(summary.plan, summary.seconds, summary.copied_files))
        checks = check_expert_weights(src, dst)
        stdout.print(weight_check_table(checks))
        if not all(c.ok for c in checks):
            raise UserError("Some expert weights are outside FP8 rounding of the original; this is a bug in "
                            "quantize-moe, please report it.")
        report = run_validation(src, dst, tokens=256)
        stdout.print(validation_table(report, wide))
        if not report.passed:
            raise UserError("The demo checkpoint failed validation; this is a bug in quantize-moe, please report it.")


def _emit(text: str, json_output: bool, json_out: Optional[Path], table) -> None:
    """A report as JSON (alone on stdout with --json; in a file with --json-out) or as its rich table."""
    if json_out is not None:
        json_out.write_text(text + "\n")
    if json_output:
        print(text)
    else:
        stdout.print(table())


@command(cls=JsonReportCommand)
@user_errors
def validate(
    src: Annotated[Path, typer.Argument(help="The original (unquantized) checkpoint folder.")],
    dst: Annotated[Path, typer.Argument(help="The FP8 checkpoint folder made from SRC (ours or another tool's).")],
    tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Hidden states drawn per layer.")] = 512,
    seed: Annotated[int, typer.Option(help="Seed of the drawn hidden states.")] = 0,
    hidden_states: Annotated[Optional[Path], typer.Option(
        help="safetensors file of real hidden states: 'layers.{L}' per layer or one 'hidden_states' [T, H].")] = None,
    data: Annotated[Optional[Path], typer.Option(metavar="FILE", help="Real inputs: SRC run over these tokens (as evaluate's --data).")] = None,
    length: Annotated[int, typer.Option(min=2, metavar="N", help="Tokens per window when --data is text.")] = 512,
    samples: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="Only the first N sequences of --data.")] = None,
    layers: Annotated[Optional[str], typer.Option(metavar="L,L",
                                                  help="Comma-separated MoE layers to check (default: all).")] = None,
    device: Annotated[str, typer.Option("--device", metavar="DEVICE", help="auto, cuda, cuda:N or cpu.")] = "auto",
    json_output: JsonFlag = False,
    json_out: JsonOut = None,
    max_relative_error: Annotated[float, typer.Option(help="Fail a layer above this ||fp8-bf16||/||bf16||.")] = Thresholds.max_relative_error,
    min_cosine: Annotated[float, typer.Option(help="Fail a layer below this cosine similarity.")] = Thresholds.min_cosine,
    max_kernel_error: Annotated[float, typer.Option(help="Fail a layer whose path is this far from the float64 reference.")] = Thresholds.max_kernel_error,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    adapter: Adapter = None,
    wide: Wide = False,
) -> None:
    """Compare each MoE layer's output: SRC's bf16 experts, DST's FP8.

    Every MoE layer runs both through the same fused-MoE layer (Triton on a GPU, the torch reference
    otherwise) on the same hidden states. Exit 3 when a layer fails a threshold."""
    import torch

    from quantize_moe.check.validate import validate as run_validation
    from quantize_moe.cli.report import validation_table

    chosen = None
    if layers:
        try:
            chosen = [int(part) for part in layers.split(",")]
        except ValueError:
            raise UsageError(f"--layers '{layers}' is not a comma-separated list of layer numbers.") from None
    thresholds = Thresholds(max_relative_error, min_cosine, max_kernel_error)
    from quantize_moe.run.tokens import load_tokens
    batches = load_tokens(data, src, length, samples) if data is not None else None
    if device == "auto" and not torch.cuda.is_available():
        console.print("no CUDA GPU here: running the torch reference path instead of the Triton kernels")
    with count_progress(progress and not json_output) as bar:
        task = bar.add_task("validating layers", total=None)
        report = run_validation(src, dst, tokens=tokens, seed=seed, device=device, hidden_states_file=hidden_states,
                                batches=batches, layers=chosen, thresholds=thresholds, adapter=adapter,
                                on_layer=lambda _, total: bar.update(task, advance=1, total=total))
    _emit(json.dumps(report.to_json(), indent=2), json_output, json_out, lambda: validation_table(report, wide))
    if not report.passed:
        failed = [str(r.layer) for r in report.layers if not r.passed]
        console.print(f"[bold red]validation failed[/] in layer(s) {', '.join(failed)}")
        raise typer.Exit(EXIT_CHECK_FAILED)


@command(cls=JsonReportCommand)
@user_errors
def evaluate(
    src: Annotated[Path, typer.Argument(help="The original (unquantized) checkpoint folder.")],
    dst: Annotated[Path, typer.Argument(help="The FP8 checkpoint folder made from SRC.")],
    data: Annotated[Path, typer.Option(help="Text (tokenized with SRC's tokenizer) or safetensors with 'input_ids' [N, T].")],
    length: Annotated[int, typer.Option(min=2, metavar="N", help="Tokens per window when --data is text.")] = 512,
    samples: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="Use only the first N sequences.")] = None,
    device: Annotated[str, typer.Option("--device", metavar="DEVICE", help="cpu, cuda or cuda:N.")] = "cpu",
    json_output: JsonFlag = False,
    json_out: JsonOut = None,
    max_perplexity_ratio: Annotated[float, typer.Option(help="Fail above this perplexity ratio FP8 / original.")] = 1.02,
    max_kl: Annotated[float, typer.Option(help="Fail above this mean KL per token.")] = 0.05,
    min_top1: Annotated[float, typer.Option(help="Fail below this top-1 agreement.")] = 0.9,
    card: Annotated[bool, typer.Option(help="Keep the report in DST (evaluation.json) and its tables in DST's card.")] = False,
) -> None:
    """Compare SRC and DST end to end: perplexity, KL, layer errors.

    Both are streamed layer by layer (one layer in memory at a time). Exit 3 when a threshold fails."""
    from quantize_moe.check.streamed_eval import EvalThresholds, evaluate as run_evaluation
    from quantize_moe.run.tokens import load_tokens
    from quantize_moe.cli.report import evaluation_table
    from quantize_moe.publish.model_card import check_card_target, record_evaluation

    for folder in (src, dst):
        if not folder.is_dir():
            raise UserError(f"'{folder}' is not a checkpoint folder.")
    if card:
        check_card_target(dst)
    batches = load_tokens(data, src, length, samples)
    report = run_evaluation(src, dst, batches, device, EvalThresholds(max_perplexity_ratio, max_kl, min_top1))
    result = report.to_json()
    _emit(json.dumps(result, indent=2), json_output, json_out, lambda: evaluation_table(report))
    if card:
        record_evaluation(dst, result)
    if not report.passed:
        console.print("[bold red]evaluation failed[/]: a threshold was not met")
        raise typer.Exit(EXIT_CHECK_FAILED)
