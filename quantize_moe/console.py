"""Terminal output: one rich console, byte-rate progress bars and number formatting."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

console = Console(stderr=True)
stdout = Console()


def byte_progress(enabled: bool = True) -> Progress:
    """A progress bar counting input bytes, with throughput and ETA."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(binary_units=False),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=console, disable=not enabled,
                    transient=False)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
