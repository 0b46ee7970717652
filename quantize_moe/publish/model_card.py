"""The model card (README.md) of a produced checkpoint, and the run record it is built from.

`quantize` writes `quantize_moe_run.json` (source, revision, options, the source card's
license and language) and a card; `upload` rebuilds the card from the output as it is
then, so a `validation.json` written later by `validate --json-out` lands in its table, and
`evaluate --card` records `evaluation.json` in the output and rebuilds the card at once.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections import Counter
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData

from quantize_moe import __version__
from quantize_moe.console import console, human_bytes
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.locations import inside
from quantize_moe.plan.compatibility import LOADS, loading_engines
from quantize_moe.errors import UserError
from quantize_moe.source.hub import HubSource
from quantize_moe.check.inventory import Inventory, take_inventory
from quantize_moe.write.manifest import Manifest
from quantize_moe.write.destination import (CARD_NAME, EVALUATION_REPORT, RUN_RECORD, VALIDATION_REPORT,
                                            write_text)
from quantize_moe.plan.options import Options
from quantize_moe.quantization.static import ActivationAmax

LOCAL_SOURCE = "SRC"
CARRIED_OVER = ("license", "license_name", "license_link", "language", "pipeline_tag")

SERVING = {
    "vLLM": "vllm serve {repo}",
    "SGLang": "python -m sglang.launch_server --model-path {repo}",
    "transformers": "AutoModelForCausalLM.from_pretrained(\"{repo}\")",
}


def _hub_origin(folder: Path) -> HubSource | None:
    """The repo and commit of a snapshot folder of huggingface_hub's cache (models--org--name/snapshots/sha)."""
    folder = folder.resolve()
    repo_folder = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo_folder.startswith("models--"):
        return None
    return HubSource(repo_folder.removeprefix("models--").replace("--", "/"), folder.name)


def reproduce_command(source: str, dst: Path, options: Options) -> str:
    """The command line that makes this output again: every option that differs from its default."""
    args = ["quantize-moe", "quantize", source, dst.name]
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return shlex.join(args)


def _source_card_metadata(folder: Path) -> dict:
    """The front matter of SRC's card, read under the rule for every file of SRC (it lives in the
    folder); a card whose YAML is broken carries nothing over, with a warning, since the weights are
    written by then and a card is no reason to fail the run."""
    path = folder / CARD_NAME
    if not path.is_file():
        return {}
    try:
        return ModelCard.load(inside(folder, CARD_NAME, f"'{folder}'")).data.to_dict()
    except (yaml.YAMLError, ValueError, UnicodeDecodeError) as e:
        console.print(f"[yellow]warning:[/] '{path}' has front matter that is not valid YAML "
                      f"({type(e).__name__}); the model card carries nothing over from it.")
        return {}


def record_run(dst: Path, checkpoint: Checkpoint, src_text: str, options: Options,
               activation_amax: ActivationAmax | None = None) -> None:
    """Write what the card needs to know about the source: where it came from and what its card said, and
    for static activations what calibration measured per layer."""
    origin = _hub_origin(checkpoint.folder)  # Hub sources are read from (or through) a cache snapshot
    metadata = _source_card_metadata(checkpoint.folder)
    _write_recorded(dst, RUN_RECORD, json.dumps({
        "tool": f"quantize-moe {__version__}",
        "base_model": origin.repo_id if origin else None,
        "base_revision": origin.revision if origin else None,
        "options": dataclasses.asdict(options),
        "requantized_from": (checkpoint.raw_config.get("quantization_config") or {}).get("quant_method")
        if options.requantize else None,
        # a local folder's path means nothing to a reader of the card: SRC stands for it
        "command": reproduce_command(origin.repo_id if origin else LOCAL_SOURCE, dst, options),
        "source_card": {k: metadata[k] for k in CARRIED_OVER if metadata.get(k)},
        "calibration": None if activation_amax is None else {
            "tokens": activation_amax.tokens, "routed_only": options.calibration_routed_only,
            "layers": activation_amax.summary()},
    }, indent=2) + "\n")


def _write_recorded(dst: Path, name: str, text: str) -> None:
    """Write a file of the output and, in a quantize-moe output, record its size and hash in the manifest."""
    write_text(dst / name, text)
    manifest = Manifest.load(dst)
    if manifest is not None:
        manifest.record(name)


def _markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _contents_table(inventory: Inventory) -> str:
    counts: Counter = Counter()
    sizes: Counter = Counter()
    for stored in inventory.tensors.values():
        key = (stored.role.kind.value, "FP8" if stored.quantized else str(stored.info.dtype).removeprefix("torch."),
               stored.role.reason or ("-" if stored.quantized else "kept by option"))
        counts[key] += 1
        sizes[key] += stored.info.nbytes
    rows = [[*key[:2], counts[key], human_bytes(sizes[key]), key[2]] for key in sorted(counts, key=lambda k: -sizes[k])]
    return _markdown_table(["tensors", "stored as", "count", "size", "why kept"], rows)


def _read_report(dst: Path, name: str, parse, what: str):
    """The JSON report `name` of DST through `parse`, None when absent; one sentence when it is not `what`."""
    path = dst / name
    if not path.is_file():
        return None
    try:
        return parse(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise UserError(f"'{path}' is not {what}.") from None


def _validation_rows(data) -> tuple[list[str], list[dict], str]:
    rows = data["layers"] if isinstance(data, dict) else data
    where = f" on {data['device']}" if isinstance(data, dict) and data.get("device") else ""
    return list(dict.fromkeys(k for row in rows for k in row)), rows, where


def _validation_section(dst: Path) -> str:
    """`validation.json` (validate's JSON report: row objects under "layers") as a table, one column per key."""
    report = _read_report(dst, VALIDATION_REPORT, _validation_rows, "a validation report (a list of row objects, "
                          "or one under 'layers'); write it with `quantize-moe validate --json-out`")
    if report is None:
        return ""
    header, rows, where = report
    table = _markdown_table(header, [[_cell(row.get(k, "")) for k in header] for row in rows])
    return f"\n## Validation\n\nEach MoE layer, FP8 against bf16, from `quantize-moe validate`{where}:\n\n{table}\n"


def _evaluation_tables(data: dict) -> tuple[str, str]:
    measures = [[key.replace("_", " "), _cell(data[key])] for key in
                ("tokens", "src_perplexity", "dst_perplexity", "perplexity_ratio", "mean_kl", "top1_agreement")]
    layers = [[row["layer"], _cell(row["relative_error"])] for row in data["layers"]]
    return _markdown_table(["measure", "value"], measures), _markdown_table(["layer", "relative error"], layers)


def _evaluation_section(dst: Path) -> str:
    """`evaluation.json` (evaluate's JSON report) as the end-to-end measures and the per-layer error."""
    tables = _read_report(dst, EVALUATION_REPORT, _evaluation_tables,
                          "an evaluation report; write it with `quantize-moe evaluate --card`")
    if tables is None:
        return ""
    return (f"\n## Evaluation\n\nThe whole model, FP8 against the original over the same tokens, from "
            f"`quantize-moe evaluate`:\n\n{tables[0]}\n\nRelative error of the hidden states after each "
            f"decoder layer:\n\n{tables[1]}\n")


def check_card_target(dst: Path) -> None:
    """Before a long evaluation: a card can only be rebuilt in a folder `quantize` wrote."""
    if not (dst / RUN_RECORD).is_file():
        raise UserError(f"'{dst / RUN_RECORD}' is missing; --card needs a DST written by `quantize-moe quantize`.")


def record_evaluation(dst: Path, report: dict) -> None:
    """Keep evaluate's report in DST (recorded in its manifest) and rebuild the card around it."""
    check_card_target(dst)
    _write_recorded(dst, EVALUATION_REPORT, json.dumps(report, indent=2) + "\n")
    write_card(dst)


def _cell(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _activations_line(qc: dict, calibration: dict | None) -> str:
    kv = qc.get("kv_cache_scheme") and calibration
    kv_line = (f"\n- KV cache: FP8, per-tensor `k_scale` / `v_scale` per attention layer, amax / 448 of the keys "
               f"and values over {calibration['tokens']} calibration tokens (vLLM uses them by itself for compressed-tensors, with `--kv-cache-dtype fp8` for native fp8)"
               if kv else "")
    rows = [] if calibration is None else [r for r in calibration["layers"] if r["min_scale"] is not None]
    if not rows:
        return f"{qc.get('activation_scheme', 'dynamic')}, quantized by the engine at run time{kv_line}"
    how = ("each expert measured on its routed tokens, unrouted ones given their layer's largest"
           if calibration["routed_only"] else "every expert measured on every token")
    routed = [f"{r['experts_routed']}/{r['experts']}" for r in rows if r["experts"]]
    return (f"static, one per-tensor `input_scale` per quantized Linear and expert projection, amax / 448 over "
            f"{calibration['tokens']} calibration tokens ({how}; experts with routed "
            f"tokens per MoE layer: {', '.join(routed) or 'none'}; scales "
            f"{min(r['min_scale'] for r in rows):.3g} to {max(r['max_scale'] for r in rows):.3g}){kv_line}")


def _engines_section(engines: tuple[str, ...], repo: str) -> str:
    if not engines:
        return "No engine is known to load this format yet."
    serving = "\n".join(SERVING[e].format(repo=repo) for e in engines)
    return f"Known to load it: {', '.join(engines)}.\n\n```\n{serving}\n```\n"


def build_card(dst: Path, repo_id: str | None = None) -> ModelCard:
    """The card of the checkpoint in `dst`, to be published as `repo_id`."""
    record_path = dst / RUN_RECORD
    if not record_path.is_file():
        raise UserError(f"'{record_path}' is missing; DST must be a folder written by `quantize-moe quantize`.")
    record = json.loads(record_path.read_text())
    checkpoint = Checkpoint(dst)
    inventory = take_inventory(checkpoint, record["options"].get("adapter"))
    qc = checkpoint.raw_config.get("quantization_config", {})
    combination = (qc.get("quant_method"), inventory.spec.weight)
    engines = tuple(loading_engines(*combination, inventory.family.name)) if combination in LOADS else ()
    repo = repo_id or dst.name
    base = record["base_model"]
    data = ModelCardData(base_model=base, base_model_relation="quantized" if base else None,
                         library_name="transformers",
                         tags=["fp8", "moe", "quantized", "quantize-moe", checkpoint.raw_config["model_type"]],
                         **{"pipeline_tag": "text-generation", **record["source_card"]})
    requantized = (f"\n**Requantized** (`--requantize`): the source was already quantized "
                   f"({record['requantized_from']}); its weights were dequantized and rounded to FP8 again, so "
                   "they carry two roundings.\n") if record.get("requantized_from") else ""
    origin = (f"[{base}](https://huggingface.co/{base})" + (f" at `{record['base_revision']}`"
              if record["base_revision"] else "")) if base else "a local checkpoint"
    stored = sum(i.nbytes for i in checkpoint.tensors.values())
    shared = ("; gate and up of each expert share one scale, so engines that fuse them load it without "
              "requantizing") if inventory.spec.weight == "tensor" else ""
    body = f"""
# {repo.split('/')[-1]}

FP8 (float8_e4m3fn) weights of {origin}, {inventory.family.name} family, made with {record['tool']}.
Routed experts and other Linear layers are FP8; what must stay in high precision for
accuracy (routers, embeddings, norms, lm_head) is kept as in the original. Size on disk: {human_bytes(stored)}.
{requantized}
## What is quantized and what is kept

{_contents_table(inventory)}

## Scheme and format

- weights: FP8 e4m3, {inventory.spec.weight} scales, scale = amax / 448 (the dequantization multiplier,
  stored as `{inventory.scale_suffix}`){shared}
- activations: {_activations_line(qc, record.get('calibration'))}
- config: `quantization_config` with `quant_method: {qc.get('quant_method')}`; the Linears kept in high
  precision are listed in its ignore list

## Engines

{_engines_section(engines, repo)}
{_validation_section(dst)}{_evaluation_section(dst)}
## Reproduce

{_reproduce_section(record)}"""
    checkpoint.close()
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


def _reproduce_section(record: dict) -> str:
    """quantize-moe is not on PyPI: the card says how to install it from its source, and names a local
    source as SRC."""
    version = record["tool"].removeprefix("quantize-moe ")
    local = (f"\n`{LOCAL_SOURCE}` is the original checkpoint, a local folder when this was made.\n"
             if record["command"].split()[2:3] == [LOCAL_SOURCE] else "")
    return f"""quantize-moe is installed from its source: a checkout of it, or the sdist that `python -m build --sdist`
makes there.

```
pip install quantize_moe-{version}.tar.gz    # or: pip install ./quantize-moe (a checkout)
{record['command']}
```
{local}"""


def write_card(dst: Path, repo_id: str | None = None) -> None:
    _write_recorded(dst, CARD_NAME, str(build_card(dst, repo_id)))
