"""The report tables fit a terminal: at 80 columns nothing is cut to an ellipsis, with --wide at 140
neither, and a tensor name that wraps breaks after a dot, never inside a part."""

from __future__ import annotations

import pytest
from rich.console import Console

from quantize_moe.check.thresholds import Thresholds
from quantize_moe.check.validate import LayerResult, ValidationReport
from quantize_moe.check.verify import Finding, VerifyReport
from quantize_moe.cli.report import decisions_table, overview_table, validation_table, verify_table
from quantize_moe.console import DottedName, short_float
from quantize_moe.plan.plan import make_plan
from quantize_moe.source.checkpoint import Checkpoint

LONG = "model.layers.61.mlp.shared_experts.e_score_correction_bias_of_a_very_long_family_name.weight"


def render(table, width: int) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(table)
    text = console.export_text()
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= width, text
    return text


def column(text: str, index: int) -> list[str]:
    """The non-empty fragments of one column of a rendered table's body rows, top to bottom."""
    cells = [line.split("│")[1:-1] for line in text.splitlines() if line.startswith("│")]
    return [row[index].strip() for row in cells if len(row) > index and row[index].strip()]


def assert_wrapped_at_dots(fragments: list[str], names: list[str]) -> None:
    """The fragments are the names in order, each piece of a wrapped name ending after a dot."""
    rest = list(fragments)
    for name in names:
        shown = ""
        while shown != name:
            piece = rest.pop(0)
            assert name.startswith(shown + piece), (name, shown, piece)
            shown += piece
            assert shown == name or shown.endswith("."), f"'{name}' split inside a part after '{shown}'"


def assert_no_split_inside_a_part(text: str, names: list[str]) -> None:
    """No line of `text` ends with the start of a name cut anywhere but after a dot."""
    for line in text.splitlines():
        cell = line.rstrip("│ ┃").rstrip()
        for name in names:
            for k in range(3, len(name)):
                head = name[:k]
                if cell.endswith(head) and (cell == head or cell[-k - 1] in " '│"):
                    assert head.endswith("."), f"'{name}' split after '{head}' in: {line}"


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    from quantize_moe.source.tiny import build_tiny_checkpoint

    folder = tmp_path_factory.mktemp("tables") / "ds"
    build_tiny_checkpoint("deepseek_v3", folder)
    return make_plan(Checkpoint(folder))


@pytest.mark.parametrize("width", [80, 140])
def test_plan_tables_fit(plan, width):
    render(overview_table(plan), width)
    render(decisions_table(plan), width)


def test_decisions_table_wide_wraps_names_at_dots(plan):
    text = render(decisions_table(plan, wide=True), 140)
    names, shown = [], ""
    for fragment in column(text, 5):  # a piece not ending in a dot ends a name
        shown += fragment
        if not shown.endswith("."):
            names.append(shown)
            shown = ""
    assert shown == "" and names and all(name in plan.decisions for name in names), names
    assert any("e_score_correction_bias" in name for name in names)
    assert column(text, 0) == ["quantized", "kept"]  # rows grouped under their action


@pytest.mark.parametrize("width", [56, 72])
def test_a_name_in_a_narrow_column_breaks_after_dots(width):
    text = render(DottedName(LONG), width)
    assert_wrapped_at_dots([line.strip() for line in text.splitlines()], [LONG])


def _validation_report() -> ValidationReport:
    row = LayerResult(layer=61, tokens=512, experts_with_tokens=256, num_experts=256, relative_error=0.0612,
                      cosine=0.9982, max_error=0.0594, bf16_kernel_error=1.6e-3, fp8_kernel_error=1.7e-3,
                      quantization_error=0.0612, passed=False)
    return ValidationReport("src", "dst", "cpu", "torch reference", "float64", Thresholds(), [row] * 3)


@pytest.mark.parametrize("width", [80, 140])
@pytest.mark.parametrize("wide", [False, True])
def test_validation_table_fits(width, wide):
    text = render(validation_table(_validation_report(), wide=wide), width)
    assert "6.1e-2" in text and "0.9982" in text and "FAIL" in text and "256/256" in text
    assert ("quant" in text) == wide and ("1.7e-3" in text) == wide


@pytest.mark.parametrize("width", [80, 140])
def test_verify_table_wraps_tensor_names_at_dots(width):
    examples = (f"'{LONG}' holds a zero or negative scale", f"FP8 weight '{LONG}' has no 'weight_scale'")
    report = VerifyReport("/data/checkpoints/DeepSeek-V3-FP8", None,
                          [Finding("scales", "fail", "2 scale tensors are not finite and positive", examples),
                           Finding("structure", "pass", "163 tensors in 1 shard(s)")])
    text = render(verify_table(report), width)
    assert_no_split_inside_a_part(text, [LONG])
    assert "fail" in text and "e_score_correction_bias_of_a_very_long_family_name." in text


def test_short_float():
    assert [short_float(x) for x in (0.0612, 1.6e-3, 12345.0, 0.0)] == ["6.1e-2", "1.6e-3", "1.2e4", "0.0e0"]
