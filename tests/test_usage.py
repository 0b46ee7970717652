"""The command line as a new user meets it at 80 columns: help without type labels after flags,
`SRC DST` usage lines, one-line command summaries, --version, one rule of exit codes, --json alike
in verify, validate and evaluate, the mode of dequantize's files, and the README's options tables
equal to the real options."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from quantize_moe import __version__
from quantize_moe.cli.app import app
from quantize_moe.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE
from quantize_moe.plan.options import FORMAT_CHOICES, SCHEME_CHOICES

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = typer.main.get_command(app).commands


def cli(*args, columns: int = 80):
    runner = CliRunner(env={"COLUMNS": str(columns)})
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False, prog_name="quantize-moe")


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_reads_plainly_at_80_columns(command):
    result = cli(*([command] if command else []), "--help")
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    options = result.output[result.output.index("─ Options ─"):]
    for label in ("<bool>", "<str>"):  # after a flag nothing, after a text option its meaning (SIZE, DEVICE)
        assert label not in options, (label, result.output)
    if command:
        arguments = [p.name.upper() for p in COMMANDS[command].params if p.param_type_name == "argument"]
        usage = next(line for line in result.output.splitlines() if "Usage:" in line)
        assert usage.strip(" │").split() == ["Usage:", "quantize-moe", command, "[OPTIONS]", *arguments], usage
        panel = result.output[result.output.find("─ Arguments ─"):result.output.index("─ Options ─")]
        for name in arguments:  # the name alone, then its help: no <str>/<path> between them
            row = next(line for line in panel.splitlines() if f" {name} " in line)
            assert re.search(rf"│ \* +{name} +[A-Z]", row), (name, panel)


def test_the_command_list_gives_each_command_one_line():
    text = cli("--help", columns=300).output
    for name, command in COMMANDS.items():
        summary = command.help.split("\n\n")[0]
        assert "\n" not in summary and len(summary) <= 64, (name, summary)  # one line at 80 columns
        assert re.search(rf"│ {name} +{re.escape(summary)} +│", text), (name, text)


def test_version():
    result = cli("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"quantize-moe {__version__}"


def test_choice_names_match_the_schemes_and_formats():
    from quantize_moe.quantization.formats import FORMATS
    from quantize_moe.quantization.schemes import SCHEMES

    assert SCHEME_CHOICES[1:] == tuple(SCHEMES) and FORMAT_CHOICES[1:] == tuple(FORMATS)


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, tmp_path_factory):
    """A tiny Qwen2-MoE (32 x 64 experts: block scales do not fit) and its FP8 copy."""
    src = tiny_checkpoint("qwen2_moe")
    dst = tmp_path_factory.mktemp("usage") / "fp8"
    assert cli("quantize", src, dst, "--no-progress").exit_code == 0
    return src, dst


BAD_USAGE = {
    "unknown option": (["--typo"], "No such option"),
    "scheme not a choice": (["--scheme", "foo"], "'foo' is not one of"),
    "format not a choice": (["--format", "gguf"], "'gguf' is not one of"),
    "size not a size": (["--max-shard-size", "big"], "--max-shard-size 'big' is not a size"),
    "no workers": (["--workers", "0"], "--workers"),
    "resume and overwrite": (["--resume", "--overwrite"], "pass only one"),
    "a combination no engine reads": (["--format", "fp8", "--scheme", "channel"], "no engine would read it"),
    "not a device": (["--device", "cuda:x"], "--device 'cuda:x' is not a device"),
}


@pytest.mark.parametrize("args, fragment", BAD_USAGE.values(), ids=BAD_USAGE)
def test_a_bad_command_line_exits_2_and_writes_nothing(pair, tmp_path, args, fragment):
    result = cli("quantize", pair[0], tmp_path / "dst", "--no-progress", *args)
    assert result.exit_code == EXIT_USAGE, result.output
    assert fragment in " ".join(result.output.split()), result.output
    assert not (tmp_path / "dst").exists()


def test_bad_input_exits_1_and_a_failed_check_3(pair, tmp_path):
    src, dst = pair
    assert cli("quantize", tmp_path / "missing", tmp_path / "dst").exit_code == EXIT_BAD_INPUT
    # an option that is fine but does not fit this checkpoint is about the input
    misfit = cli("quantize", src, tmp_path / "dst", "--scheme", "block", "--no-progress")
    assert misfit.exit_code == EXIT_BAD_INPUT and "does not fit" in misfit.output
    assert cli("validate", src, dst, "--layers", "zero").exit_code == EXIT_USAGE
    strict = cli("validate", src, dst, "--tokens", "16", "--min-cosine", "1.0", "--no-progress")
    assert strict.exit_code == EXIT_CHECK_FAILED, strict.output
    assert cli("verify", dst).exit_code == EXIT_OK


def test_readme_states_the_exit_codes_once():
    readme = (ROOT / "README.md").read_text().replace("**", "")
    assert readme.count("Exit codes") == 1 and readme.count("exit code 1") == 0
    assert "0 done" in readme and "1 bad input" in readme and "2 bad usage" in readme and "3 a check" in readme


def test_quantize_and_inspect_say_what_auto_chose(pair, tmp_path):
    src = pair[0]
    for result in (cli("inspect", src), cli("quantize", src, tmp_path / "dst", "--no-progress")):
        assert result.exit_code == 0, result.output
        line = next(line for line in result.output.splitlines() if line.startswith("auto chose"))
        assert "--format compressed-tensors --scheme channel" in line and "fp8 / block does not fit" in line
    pinned = cli("inspect", src, "--format", "compressed-tensors", "--scheme", "tensor")
    assert "auto chose" not in pinned.output
    half = cli("inspect", src, "--scheme", "tensor")
    assert "auto chose --format compressed-tensors --scheme tensor: loads in vLLM and transformers" in half.output


def test_inspect_of_an_fp8_src_says_quantize_needs_requantize(pair, tmp_path):
    src, dst = pair
    result = cli("inspect", dst, columns=300)  # under auto its own scheme: quantize has nothing to do
    assert result.exit_code == 0, result.output
    assert re.search(r"│ source quantization +│ channel FP8 \(weight_scale\): quantize takes it only with "
                     r"--requantize \(every weight rounded twice\); dequantize writes it in bf16 +│", result.output)
    assert "source quantization" not in cli("inspect", src, columns=300).output
    refused = cli("quantize", dst, tmp_path / "again", "--scheme", "tensor", "--no-progress")
    assert refused.exit_code == EXIT_BAD_INPUT and "--requantize" in refused.output


def test_json_is_a_flag_everywhere_and_json_out_writes_a_file(pair, tmp_path):
    src, dst = pair
    validate = ["validate", src, dst, "--tokens", "16", "--layers", "0", "--no-progress"]
    for command in (["verify", dst], validate):
        alone = cli(*command, "--json")
        assert alone.exit_code == 0 and isinstance(json.loads(alone.stdout), dict), alone.output
        out = tmp_path / f"{command[0]}.json"
        both = cli(*command, "--json-out", out)
        assert both.exit_code == 0 and json.loads(out.read_text()) and "┃" in both.stdout
    legacy = tmp_path / "legacy.json"
    old = cli(*validate, "--json", legacy)  # the old form still works, with a note
    assert old.exit_code == 0 and json.loads(legacy.read_text())["passed"] is True
    assert "--json PATH is deprecated" in old.stderr
    assert json.loads(cli(*validate, "--json", "-").stdout)["passed"] is True


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_dequantize_writes_files_with_the_mode_of_the_umask(pair, tmp_path, umask):
    old = os.umask(umask)
    try:
        result = cli("dequantize", pair[1], tmp_path / "bf16")
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert re.search(r"wrote \d+ tensors in bf16 \(\d+\.\d+ KB, 1 shard\(s\)\) to", " ".join(result.output.split()))
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "bf16").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


def _table_options(section: str) -> set[str]:
    """The options named in the first column of the options table under a README heading."""
    readme = (ROOT / "README.md").read_text()
    body = readme[readme.index(section):]
    body = body[:body.index("\n#", 1)]
    rows = [line.split("|")[1] for line in body.splitlines() if line.startswith("| `")]
    return {flag for cell in rows for flag in re.findall(r"--[a-z][a-z-]*", cell)}


@pytest.mark.parametrize("command, section", [("quantize", "### `quantize-moe quantize SRC DST`"),
                                              ("validate", "### `quantize-moe validate SRC DST`")])
def test_readme_options_table_is_the_real_options(command, section):
    real = {opt for p in COMMANDS[command].params if p.param_type_name == "option"
            for opt in p.opts + p.secondary_opts} - {"--help", "--progress"}
    assert _table_options(section) == real
