"""Rich tables that tell people what a plan does and what a run did.

Every table fits 80 columns: the default view has the columns needed to judge the result, short
numbers and names wrapping at their dots; `wide=True` (`--wide`) adds the rest."""

from __future__ import annotations

from collections import Counter

from rich.console import Group
from rich.table import Table
from rich.text import Text

from quantize_moe.adapters import Kind
from quantize_moe.console import DottedName, human_bytes, short_float
from quantize_moe.plan.compatibility import block_tp_sizes, verdicts
from quantize_moe.plan.plan import Plan
from quantize_moe.check.validate import ValidationReport


def _layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            spans.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(spans) or "none"


def overview_table(plan: Plan) -> Table:
    """Family, MoE layout and sizes."""
    table = Table(title="Checkpoint", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    moe = plan.moe_layers
    table.add_row("folder", str(plan.checkpoint.folder))
    table.add_row("family (adapter)", f"{plan.family.name} ({plan.config.model_type})")
    table.add_row("layers", str(plan.config.num_hidden_layers))
    table.add_row("MoE layers", f"{len(moe)}: {_layer_ranges([m.layer for m in moe])}")
    if moe:
        table.add_row("experts per layer", f"{moe[0].num_experts} (top-{moe[0].top_k})")
        table.add_row("expert width x hidden", f"{moe[0].expert_width} x {moe[0].hidden_size}")
        table.add_row("expert layout", _expert_layout(plan))
    if plan.mtp_layers:
        table.add_row("MTP layers", f"{_layer_ranges(plan.mtp_layers)} (multi-token prediction, kept in high "
                      "precision)")
    if plan.source.quantized:
        table.add_row("source quantization", f"{plan.source.spec.weight} FP8 ({plan.source.scale_suffix}): quantize "
                      "takes it only with --requantize (every weight rounded twice); dequantize writes it in bf16")
    table.add_row("scheme / format", f"{plan.options.scheme} / {plan.options.format}")
    if plan.family.fp8_refusal or any(not layout.unfused for layout in plan.family.fused):  # its own loaders decide
        table.add_row("FP8 output loads in", plan.family.fp8_loads_in or f"nowhere: {plan.family.fp8_refusal}")
    else:
        for engine, verdict in verdicts(plan.options.format, plan.options.scheme, plan.family.name).items():
            table.add_row(f"loads in {engine}", f"[green]{verdict}[/]" if verdict == "yes" else f"[yellow]{verdict}[/]")
    if plan.options.scheme == "block" and moe:
        sizes = block_tp_sizes({m.expert_width for m in moe}, plan.scheme.block[0])
        table.add_row("TP sizes, whole blocks", ", ".join(map(str, sizes)))
    table.add_row("size before -> after",
                  f"{human_bytes(plan.bytes_before)} -> {human_bytes(plan.bytes_after)} "
                  f"in {len(plan.shards)} shard(s)")
    return table


def _expert_layout(plan: Plan) -> str:
    on_disk = {d.role.fused for d in plan.decisions.values() if d.role.kind == Kind.ROUTED_EXPERT}
    if on_disk == {None}:
        return "one Linear per expert and projection"
    parts = []
    for layout in plan.family.fused:
        notes = [n for n, on in (("experts concatenated", layout.flat), ("transposed: in x out per expert", layout.transposed),
                                 ("shards interleaved", layout.interleaved)) if on]
        parts.append(f"{layout.name.replace(chr(92), '')} -> {'+'.join(layout.shards)}"
                     + (f" ({', '.join(notes)})" if notes else ""))
    unfused = all(layout.unfused for layout in plan.family.fused)
    return "fused: " + "; ".join(parts) + ("; written one Linear per expert and projection" if unfused else "")


def decisions_table(plan: Plan, wide: bool = False) -> Table:
    """How many tensors of each kind are quantized or kept, and why: rows grouped by action, an
    example tensor of each row with `wide`."""
    rows: Counter = Counter()
    sizes: Counter = Counter()
    examples: dict = {}
    for d in plan.decisions.values():
        key = ("quantized" if d.quantize else "kept", d.role.kind.value, d.reason)
        rows[key] += 1
        sizes[key] += d.info.nbytes
        examples.setdefault(key, d.info.name)
    table = Table(title="What is quantized and what stays")
    table.add_column("action")
    table.add_column("kind")
    table.add_column("tensors", justify="right")
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("reason", ratio=1)
    if wide:
        table.add_column("example", ratio=1)
    ordered = sorted(rows, key=lambda k: (k[0] != "quantized", -sizes[k]))
    for i, key in enumerate(ordered):
        action, kind, reason = key
        first = i == 0 or ordered[i - 1][0] != action
        last = i + 1 == len(ordered) or ordered[i + 1][0] != action
        style = "green" if action == "quantized" else "yellow"
        cells = [f"[{style}]{action}[/]" if first else "", kind, str(rows[key]), human_bytes(sizes[key]),
                 reason or "-"]
        table.add_row(*cells, *([DottedName(examples[key])] if wide else []), end_section=last)
    return table


def run_table(plan: Plan, seconds: float, copied_files: list[str]) -> Table:
    quantized = sum(d.quantize for d in plan.decisions.values())
    table = Table(title="Result", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("tensors quantized", str(quantized))
    table.add_row("tensors kept", str(len(plan.decisions) - quantized))
    table.add_row("bytes before -> after", f"{human_bytes(plan.bytes_before)} -> {human_bytes(plan.bytes_after)} "
                  f"({plan.bytes_after / max(plan.bytes_before, 1):.0%})")
    table.add_row("files copied", ", ".join(copied_files) or "none")
    table.add_row("time", f"{seconds:.1f} s ({human_bytes(plan.bytes_before / max(seconds, 1e-9))}/s)")
    return table


def validation_table(report: ValidationReport, wide: bool = False) -> Table:
    """Per MoE layer: FP8 against bf16 and the verdict; `wide` adds each path's error against the float64
    reference and the quantization error alone."""
    table = Table(title=f"Validation: {report.path} on {report.device}, reference in {report.reference_dtype}")
    columns = ["layer", "experts", "rel\nerr", "cosine", "max\nerr"]  # two-line headers: all 9 fit 80 columns
    if wide:
        columns += ["bf16\nvs ref", "fp8\nvs ref", "quant\nerr"]
    for column in (*columns, "ok"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in report.layers:
        cells = [str(r.layer), f"{r.experts_with_tokens}/{r.num_experts}", short_float(r.relative_error),
                 f"{r.cosine:.4f}", short_float(r.max_error)]
        if wide:
            cells += [short_float(r.bf16_kernel_error), short_float(r.fp8_kernel_error),
                      short_float(r.quantization_error)]
        table.add_row(*cells, "[green]pass[/]" if r.passed else "[bold red]FAIL[/]")
    t = report.thresholds
    table.caption = (f"fail: rel err > {t.max_relative_error}, cosine < {t.min_cosine}, or a path > "
                     f"{t.max_kernel_error} from the reference" + ("" if wide else " (--wide shows them)")
                     + (f"\n{report.routing_note}: tokens may reach other experts than in the real model"
                        if report.routing_note else ""))
    return table


VERDICT_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def verify_table(report) -> Table:
    """One row per check of `quantize-moe verify`, with the first offending tensors or files."""
    table = Table(title=f"verify {report.checkpoint}" + (f" against {report.against}" if report.against else ""))
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", ratio=1)
    for f in report.findings:
        detail = Group(Text(f.message), *(DottedName(e, indent=2) for e in f.examples))
        table.add_row(f.check, f"[{VERDICT_STYLE[f.status]}]{f.status}[/]", detail)
    return table


def weight_check_table(checks) -> Table:
    """`demo`'s check of the routed experts: dequantized FP8 against the original, per layer."""
    table = Table(title="Routed experts: dequantized FP8 vs original")
    for column in ("layer", "rel err", "worst / rounding bound", "ok"):
        table.add_column(column, justify="right")
    for c in checks:
        table.add_row(str(c.layer), short_float(c.relative_error), f"{c.worst_bound_ratio:.3f}",
                      "[green]yes[/]" if c.ok else "[red]NO[/]")
    return table


def evaluation_table(report) -> Group:
    """The `evaluate` result: one row per measure, then the hidden-state error after each decoder layer."""
    table = Table(title=f"End-to-end: FP8 against the original over {report.tokens} tokens")
    for column in ("measure", "value"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_row("perplexity (original)", f"{report.src_perplexity:.4f}")
    table.add_row("perplexity (FP8)", f"{report.dst_perplexity:.4f}")
    table.add_row("perplexity ratio", f"{report.perplexity_ratio:.5f}")
    table.add_row("mean KL(orig || fp8) per token", short_float(report.mean_kl))
    table.add_row("top-1 agreement", f"{report.top1_agreement:.4f}")
    table.add_row("passed", "[green]yes[/]" if report.passed else "[red]NO[/]")
    layers = Table(title="Hidden-state error")
    for column in ("layer", "relative error"):
        layers.add_column(column, justify="right")  # relative: ||fp8 - orig|| / ||orig||
    for row in report.layers:
        layers.add_row(str(row.layer), f"{row.relative_error:.2e}")
    return Group(table, layers)


def calibration_table(amax) -> Table:
    """What calibration measured per decoder layer: experts that got routed tokens, the spread of the input
    scales (every expert has one either way) and the KV-cache scales."""
    rows = amax.summary()
    kv = any("k_scale" in row for row in rows)
    table = Table(title=f"Calibrated scales from {amax.tokens} calibration tokens")
    for column in ("layer", "experts with routed tokens", "smallest input scale", "largest input scale",
                   *(("k_scale", "v_scale") if kv else ())):
        table.add_column(column, justify="right", no_wrap=True)
    scale = lambda value: "-" if value is None else f"{value:.3e}"  # noqa: E731
    for row in rows:
        routed = "-" if row["experts"] is None else f"{row['experts_routed']} / {row['experts']}"
        if row["experts"] and row["experts_routed"] < row["experts"]:
            routed = f"[yellow]{routed}[/]"
        kv_cells = (scale(row.get("k_scale")), scale(row.get("v_scale"))) if kv else ()
        table.add_row(str(row["layer"]), routed, scale(row["min_scale"]), scale(row["max_scale"]), *kv_cells)
    return table
