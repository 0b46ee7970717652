"""The `quantize-moe` command line.

Torch, transformers and the stages that need them are imported inside the commands, so `--help`
and a mistyped option answer at once instead of after seconds of imports."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantize_moe.check.thresholds import Thresholds
from quantize_moe.console import console, count_progress, stdout
from quantize_moe.errors import UserError
from quantize_moe.plan.options import GPU_WORKERS_PER_DEVICE, Options

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  help="Quantize Hugging Face Mixture-of-Experts checkpoints to FP8 and prove them correct.")


def user_errors(command):
    """Report a UserError, or a failing file system (full disk, no permission), as one red sentence
    and exit 1, without a traceback."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except UserError as e:
            message = str(e)
        except OSError as e:
            where = f"'{e.filename}': " if e.filename else ""
            message = (f"{where}{e.strerror or e}; fix this and run the command again "
                       "(quantize continues where it stopped with --resume).")
        # soft_wrap: the terminal wraps the line, so paths in it are never broken for copying
        console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    return run


def _shard_size(value: str) -> int:
    from transformers.utils.hub import convert_file_size_to_int

    try:
        return convert_file_size_to_int(value)
    except ValueError:
        raise UserError(f"--max-shard-size '{value}' is not a size; write it like 5GB, 500MB or 1000000.") \
            from None


ExpertsOnly = Annotated[bool, typer.Option("--experts-only", help="Quantize the routed and shared experts only.")]
MaxShardSize = Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB or 500MB.")]
AllowPickle = Annotated[bool, typer.Option(
    "--allow-pickle", help="Read a checkpoint that has only pickle weights (.bin), weights-only: pickle "
                           "objects that would run code are refused.")]
Overwrite = Annotated[bool, typer.Option(help="Replace the checkpoint in a non-empty DST.")]
Private = Annotated[bool, typer.Option(help="Create the Hub repo as private (when it does not exist yet).")]
Adapter = Annotated[Optional[str], typer.Option(
    help="generic: read an unknown model_type through the generic per-expert adapter (see `inspect`).")]
STREAM_SCRATCH = ".quantize-moe-download"  # hidden in DST: never copied, uploaded or taken for output
Scheme = Annotated[str, typer.Option(help="Weight scales: tensor, channel (one per output row), block (128x128), "
                                          "or auto: the choice that loads in the most engines.")]
Format = Annotated[str, typer.Option("--format", help="On-disk format: fp8 (vLLM/SGLang native; block scales also "
                                                      "transformers), compressed-tensors, or auto.")]


@app.command()
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
        help="Continue an interrupted run in DST: shards its manifest lists as finished (and that still "
             "match their hashes) are kept, the rest is written again.")] = False,
    allow_pickle: AllowPickle = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    stream: Annotated[bool, typer.Option(help="Hub SRC: download, quantize and delete shards one by one "
                                              "instead of caching the whole model.")] = False,
    push_to_hub: Annotated[str | None, typer.Option(help="Then upload DST to this Hub repo (org/name).")] = None,
    private: Private = False,
    adapter: Adapter = None,
    device: Annotated[str, typer.Option("--device", "--devices",
                                        help="Where to quantize: cpu, cuda, or several GPUs as cuda:0,cuda:1."
                                        )] = "cpu",
    workers: Annotated[int | None, typer.Option(help="Work items in flight at once, spread over the "
                                                f"devices (default: one per core on cpu, {GPU_WORKERS_PER_DEVICE} per GPU).")] = None,
) -> None:
    """Write an FP8 copy of SRC into DST: weights, scales, config.json with quantization_config,
    a manifest of every file's size and digest, a model card, and every other file of SRC unchanged."""
    from quantize_moe.source.hub import open_source
    from quantize_moe.publish.model_card import record_run, write_card
    from quantize_moe.cli.report import decisions_table, run_table
    from quantize_moe.write.job import quantize_checkpoint

    options = Options(experts_only=experts_only, scheme=scheme, format=format_,
                      max_shard_size=_shard_size(max_shard_size), adapter=adapter)
    with open_source(src, stream=stream, scratch=dst / STREAM_SCRATCH, allow_pickle=allow_pickle) as checkpoint:
        summary = quantize_checkpoint(checkpoint, dst, options, overwrite=overwrite, resume=resume,
                                      show_progress=progress, device=device,
                                      workers=workers)
        record_run(dst, checkpoint, src, summary.plan.options)
    write_card(dst, push_to_hub)
    stdout.print(decisions_table(summary.plan))
    stdout.print(run_table(summary.plan, summary.seconds, summary.copied_files))
    stdout.print(f"[green]wrote[/] {dst}")
    if push_to_hub:
        _upload(dst, push_to_hub, private)


@app.command()
@user_errors
def upload(
    dst: Annotated[Path, typer.Argument(help="Folder written by `quantize-moe quantize`.")],
    repo_id: Annotated[str, typer.Argument(help="Hub model repo to upload to (org/name); created if missing.")],
    private: Private = False,
) -> None:
    """Upload DST to the Hub with a generated model card; re-run to resume an interrupted upload.
    Uses HF_TOKEN or the token of `hf auth login`."""
    _upload(dst, repo_id, private)


def _upload(dst: Path, repo_id: str, private: bool) -> None:
    from quantize_moe.publish.upload import upload as upload_folder

    stdout.print(f"[green]uploaded[/] {upload_folder(dst, repo_id, private=private)}")


@app.command()
@user_errors
def verify(
    dst: Annotated[Path, typer.Argument(help="Quantized checkpoint folder to check.")],
    against: Annotated[str | None, typer.Option(help="Source checkpoint (folder or Hub repo id): also check "
                                                     "shapes and numerics against it.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    adapter: Adapter = None,
) -> None:
    """Check DST for CI: structure, metadata, scales, shared gate/up scales, coverage, integrity and,
    with --against, numerics. Exit codes: 0 passed, 1 DST or SRC unreadable, 2 bad usage,
    3 a check failed."""
    from quantize_moe.source.hub import open_source
    from quantize_moe.check.verify import verify as verify_checkpoint
    from quantize_moe.cli.report import verify_table

    source = open_source(against) if against else None
    report = verify_checkpoint(dst, source, adapter)
    if json_output:
        print(report.to_json())
    else:
        stdout.print(verify_table(report))
        stdout.print("[green]all checks passed[/]" if report.ok else "[red]verification failed[/]")
    raise typer.Exit(report.exit_code)


@app.command()
@user_errors
def inspect(
    src: Annotated[str, typer.Argument(help="Checkpoint folder, or Hub repo id org/name or org/name@revision.")],
    experts_only: ExpertsOnly = False,
    scheme: Scheme = "auto",
    format_: Format = "auto",
    max_shard_size: MaxShardSize = "5GB",
    allow_pickle: AllowPickle = False,
    adapter: Adapter = None,
) -> None:
    """Describe SRC: family, MoE layers, experts, what would be quantized and what stays, sizes, and
    which engines load the result. Reads metadata only (from the Hub: small files and shard headers,
    no shards). An unknown model_type is described as the generic adapter would read it."""
    from quantize_moe.adapters import is_known
    from quantize_moe.cli.report import decisions_table, overview_table
    from quantize_moe.plan.plan import make_plan
    from quantize_moe.source.hub import open_source

    checkpoint = open_source(src, stream=True, allow_pickle=allow_pickle)
    shown = adapter or (None if is_known(checkpoint.raw_config) else "generic")
    plan = make_plan(checkpoint, Options(experts_only=experts_only, scheme=scheme, format=format_,
                                         max_shard_size=_shard_size(max_shard_size), adapter=shown))
    stdout.print(overview_table(plan))
    stdout.print(decisions_table(plan))
    if shown and not adapter:
        stdout.print(f"[yellow]model_type '{checkpoint.raw_config.get('model_type')}' is not a known family: this "
                     "is what the generic adapter would do; quantize, validate and verify use it only with "
                     "--adapter generic.[/]")


@app.command()
@user_errors
def dequantize(
    src: Annotated[Path, typer.Argument(help="FP8 checkpoint folder (ours, AutoFP8, llm-compressor, block FP8).")],
    dst: Annotated[Path, typer.Argument(help="Output folder for the bf16 checkpoint.")],
    overwrite: Overwrite = False,
) -> None:
    """Write a bf16 copy of an FP8 checkpoint, without scales or quantization_config: the way to
    requantize a checkpoint that is already FP8."""
    from quantize_moe.write.dequantize import dequantize_checkpoint

    dequantize_checkpoint(src, dst, overwrite=overwrite)
    stdout.print(f"[green]wrote[/] {dst}")


@app.command()
@user_errors
def demo(
    family: Annotated[str, typer.Option(help="model_type of the tiny checkpoint to build.")] = "mixtral",
) -> None:
    """Build a small checkpoint of a real MoE family, quantize it, check it and print the report.
    Runs offline on a CPU."""
    from quantize_moe.cli.report import decisions_table, overview_table, run_table, validation_table
    from quantize_moe.write.job import quantize_checkpoint
    from quantize_moe.source.tiny import TINY_CONFIGS, build_tiny_checkpoint

    from quantize_moe.adapters import adapter_for

    # gpt-oss and Llama-4: `quantize` refuses them (no engine loads their fused experts in FP8)
    choices = [t for t in TINY_CONFIGS if not adapter_for({"model_type": t}).fp8_refusal]
    if family not in choices:
        raise UserError(f"--family {family} has no demo checkpoint; choose one of {', '.join(choices)}.")
    with tempfile.TemporaryDirectory(prefix="quantize-moe-demo-") as tmp:
        src, dst = Path(tmp) / "bf16", Path(tmp) / "fp8"
        console.print(f"building a tiny {family} checkpoint with transformers in {src}")
        build_tiny_checkpoint(family, src, max_shard_size="200KB")
        summary = quantize_checkpoint(src, dst, Options(max_shard_size=200_000))
        stdout.print(overview_table(summary.plan))
        stdout.print(decisions_table(summary.plan))
        stdout.print(run_table(summary.plan, summary.seconds, summary.copied_files))
        _report_weight_check(src, dst)
        from quantize_moe.check.validate import validate as run_validation

        report = run_validation(src, dst, tokens=256)
        stdout.print(validation_table(report))
        if not report.passed:
            raise UserError("The demo checkpoint failed validation; this is a bug in quantize-moe, please report it.")


def _emit(report, json_path: Optional[Path], table) -> None:
    """A report as JSON (to a file, or alone on stdout for '-') and as its rich table."""
    if json_path is not None:
        text = json.dumps(report.to_json(), indent=2)
        if json_path == Path("-"):
            print(text)
        else:
            json_path.write_text(text + "\n")
    if json_path != Path("-"):
        stdout.print(table(report))


@app.command()
@user_errors
def validate(
    src: Annotated[Path, typer.Argument(help="The original (unquantized) checkpoint folder.")],
    dst: Annotated[Path, typer.Argument(help="The FP8 checkpoint folder made from SRC (ours or another tool's).")],
    tokens: Annotated[int, typer.Option(min=1, help="Hidden states drawn per layer.")] = 512,
    seed: Annotated[int, typer.Option(help="Seed of the drawn hidden states.")] = 0,
    hidden_states: Annotated[Optional[Path], typer.Option(
        help="safetensors file of real hidden states: 'layers.{L}' per layer or one 'hidden_states' [T, H].")] = None,
    layers: Annotated[Optional[str], typer.Option(help="Comma-separated MoE layers to check (default: all).")] = None,
    device: Annotated[str, typer.Option(help="auto, cuda, cuda:N or cpu.")] = "auto",
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON here ('-': stdout only).")] = None,
    max_relative_error: Annotated[float, typer.Option(help="Fail a layer above this ||fp8-bf16||/||bf16||.")] = Thresholds.max_relative_error,
    min_cosine: Annotated[float, typer.Option(help="Fail a layer below this cosine similarity.")] = Thresholds.min_cosine,
    max_kernel_error: Annotated[float, typer.Option(help="Fail a layer whose path is this far from the float64 reference.")] = Thresholds.max_kernel_error,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    adapter: Adapter = None,
) -> None:
    """Run every MoE layer with the bf16 experts of SRC and the FP8 experts of DST through the same
    fused-MoE layer (Triton on a GPU, the torch reference otherwise) and report the error per layer.
    Exit code 0: every layer passed; 1: bad input; 2: bad usage; 3: some layer failed."""
    import torch

    from quantize_moe.check.validate import validate as run_validation
    from quantize_moe.cli.report import validation_table

    chosen = None
    if layers:
        try:
            chosen = [int(part) for part in layers.split(",")]
        except ValueError:
            raise UserError(f"--layers '{layers}' is not a comma-separated list of layer numbers.") from None
    thresholds = Thresholds(max_relative_error, min_cosine, max_kernel_error)
    if device == "auto" and not torch.cuda.is_available():
        console.print("no CUDA GPU here: running the torch reference path instead of the Triton kernels")
    with count_progress(progress and json_path != Path("-")) as bar:
        task = bar.add_task("validating layers", total=None)
        report = run_validation(src, dst, tokens=tokens, seed=seed, device=device, hidden_states_file=hidden_states,
                                layers=chosen, thresholds=thresholds, adapter=adapter,
                                on_layer=lambda _, total: bar.update(task, advance=1, total=total))
    _emit(report, json_path, validation_table)
    if not report.passed:
        failed = [str(r.layer) for r in report.layers if not r.passed]
        console.print(f"[bold red]validation failed[/] in layer(s) {', '.join(failed)}")
        raise typer.Exit(3)


def _report_weight_check(src: Path, dst: Path) -> None:
    from rich.table import Table

    from quantize_moe.check.weights import check_expert_weights

    table = Table(title="Routed experts: dequantized FP8 vs original")
    for column in ("layer", "relative error", "worst error / FP8 rounding bound", "ok"):
        table.add_column(column)
    checks = check_expert_weights(src, dst)
    for c in checks:
        table.add_row(str(c.layer), f"{c.relative_error:.2e}", f"{c.worst_bound_ratio:.3f}",
                      "[green]yes[/]" if c.ok else "[red]NO[/]")
    stdout.print(table)
    if not all(c.ok for c in checks):
        raise UserError("Some expert weights are outside FP8 rounding of the original; this is a bug in "
                        "quantize-moe, please report it.")


@app.command()
@user_errors
def evaluate(
    src: Annotated[Path, typer.Argument(help="The original (unquantized) checkpoint folder.")],
    dst: Annotated[Path, typer.Argument(help="The FP8 checkpoint folder made from SRC.")],
    data: Annotated[Path, typer.Option(help="Text (tokenized with SRC's tokenizer) or safetensors with 'input_ids' [N, T].")],
    length: Annotated[int, typer.Option(min=2, help="Tokens per window when --data is text.")] = 512,
    samples: Annotated[Optional[int], typer.Option(min=1, help="Use only the first N sequences.")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON here ('-': stdout only).")] = None,
    max_perplexity_ratio: Annotated[float, typer.Option(help="Fail above this perplexity ratio FP8 / original.")] = 1.02,
    max_kl: Annotated[float, typer.Option(help="Fail above this mean KL per token.")] = 0.05,
    min_top1: Annotated[float, typer.Option(help="Fail below this top-1 agreement.")] = 0.9,
) -> None:
    """Stream SRC and DST layer by layer over the same tokens (one layer in memory at a time) and compare
    perplexity, KL and top-1 agreement. Exit code 0: passed; 1: bad input; 2: bad usage; 3: a threshold failed."""
    from quantize_moe.check.streamed_eval import EvalThresholds, evaluate as run_evaluation, load_tokens
    from quantize_moe.cli.report import evaluation_table

    for folder in (src, dst):
        if not folder.is_dir():
            raise UserError(f"'{folder}' is not a checkpoint folder.")
    batches = load_tokens(data, src, length, samples)
    report = run_evaluation(src, dst, batches, device, EvalThresholds(max_perplexity_ratio, max_kl, min_top1))
    _emit(report, json_path, evaluation_table)
    if not report.passed:
        console.print("[bold red]evaluation failed[/]: a threshold was not met")
        raise typer.Exit(3)
