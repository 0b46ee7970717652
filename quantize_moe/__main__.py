"""`python -m quantize_moe`: the same as the `quantize-moe` command."""

from quantize_moe.cli.app import app

app(prog_name="quantize-moe")
