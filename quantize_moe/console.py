"""Terminal output: one rich console, byte-rate progress bars and number formatting."""

from __future__ import annotations

import os
import sys

from rich.console import Console
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
