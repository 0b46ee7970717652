"""How the commands read in a terminal: help without a type label after a flag (`--resume`, not
`--resume <bool>`) or an argument (`SRC`, not `SRC <str>`), usage lines naming arguments as `SRC DST`,
and the deprecated `--json PATH` of `validate` and `evaluate` still understood."""

from __future__ import annotations

import inspect
import re

from typer.core import TyperCommand, TyperGroup

from quantize_moe.console import console


class _PlainHelp:
    """Mixed into typer's command and group classes; everything else is typer's own rendering."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.help:  # typer keeps a docstring's line breaks after its first paragraph; the terminal wraps
            self.help = re.sub(r"(?<!\n)\n(?!\n)", " ", inspect.cleandoc(self.help))

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if param.param_type_name == "argument":
                param.metavar = param.metavar or param.name.upper()
                param.display_type_rich = lambda ctx: None  # SRC, DST say what they are: no <str>/<path>
            elif getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""  # a flag takes no value, so nothing follows it in the help
        return params

    def collect_usage_pieces(self, ctx):
        # typer writes required arguments as {src}; a usage line reads `SRC DST`
        return [re.sub(r"\{([^}]*)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]


class Command(_PlainHelp, TyperCommand):
    """Every command of the app."""


class Group(_PlainHelp, TyperGroup):
    """The app itself (its `--help` and `--version`)."""


class JsonReportCommand(Command):
    """`validate` and `evaluate`, whose `--json` once took a path: `--json PATH` (a name ending in .json)
    and `--json=PATH` still write the file, with a note, and `--json -` is `--json`."""

    def parse_args(self, ctx, args):
        rewritten, rest = [], list(args)
        while rest:
            arg = rest.pop(0)
            value = arg.partition("=")[2] if arg.startswith("--json=") else None
            if arg == "--json" and rest and (rest[0] == "-" or rest[0].endswith(".json")):
                value = rest.pop(0)
            if value is None:
                rewritten.append(arg)
            elif value == "-":
                rewritten.append("--json")
            else:
                console.print(f"note: --json PATH is deprecated; write --json-out {value} (--json alone "
                              "prints the JSON on stdout).", highlight=False, soft_wrap=True)
                rewritten += ["--json-out", value]
        return super().parse_args(ctx, rewritten)
