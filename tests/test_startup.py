"""The command line starts without torch, transformers or safetensors' torch layer: `--help` and a usage
error must answer at once (issue 18). A test of what is imported, not of timings."""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "safetensors.torch")


def _imported_after(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_the_cli_imports_nothing_heavy():
    assert not set(HEAVY) & _imported_after("import quantize_moe.cli.app")


@pytest.mark.parametrize("argv", [["--help"], ["quantize", "--help"], ["quantize", "--typo", "a", "b"],
                                  ["validate"]])
def test_help_and_usage_errors_import_nothing_heavy(argv):
    code = ("import sys\nfrom quantize_moe.cli.app import app\n"
            f"try:\n    app({argv!r})\nexcept SystemExit:\n    pass")
    assert not set(HEAVY) & _imported_after(code)


def test_verify_starts_hashing_before_importing_anything_heavy():
    """verify's integrity check is started first, so DST hashes while torch is imported."""
    assert not set(HEAVY) & _imported_after("import quantize_moe.check.integrity")
