"""Terminal output: one rich console, byte-rate progress bars, number formatting and names that
wrap at their dots."""

from __future__ import annotations

import os
import re
import sys

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.text import Text
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn, TransferSpeedColumn)

# Without a terminal (CI logs, pipes) rich would wrap tables at 80 columns; logs can be wider.
_WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 140
console = Console(stderr=True, width=_WIDTH)
stdout = Console(width=_WIDTH)


def byte_progress(enabled: bool = True) -> Progress:
    """A progress bar counting input bytes, with throughput and ETA."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(binary_units=False),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=console, disable=not enabled,
                    transient=False)


def count_progress(enabled: bool = True) -> Progress:
    """A progress bar counting items (layers, files), with elapsed time and ETA."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=not enabled)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def short_float(x: float) -> str:
    """2 significant digits with a bare exponent, 6.1e-2 rather than 6.1e-02: columns stay narrow."""
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{m[1].replace('+', '')}{m[2]}", f"{x:.1e}")


class DottedName:
    """Text holding tensor, module or file names that wraps after a dot or at a space, never inside a
    part: rich wraps only at spaces and would cut `model.layers.1.mlp.experts` anywhere, so a wrapped
    name still reads as one."""

    def __init__(self, text: str, style: str = "", indent: int = 0):
        self.style, self.indent = style, indent
        self.parts = re.findall(r"[^.\s]*(?:\.|\s+)|[^.\s]+$", text) or [text]

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(self.indent + max(len(p.rstrip()) for p in self.parts),
                           self.indent + len("".join(self.parts).rstrip()))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width, lines = max(options.max_width - self.indent, 1), [""]
        for part in self.parts:
            if lines[-1] and len(lines[-1]) + len(part.rstrip()) > width:
                lines.append("")
            lines[-1] += part
        for line in lines:  # a part wider than the column folds, as rich's overflow="fold" would
            yield Text(" " * self.indent + line.rstrip(), style=self.style, overflow="fold")
