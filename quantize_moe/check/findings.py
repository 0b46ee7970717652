"""What each of `verify`'s checks yields: one `Finding`, passed (with a summary), or warned / failed
with the count and the first offending tensors or files. Torch-free, like `check.integrity`."""

from __future__ import annotations

from dataclasses import dataclass

EXAMPLES = 5


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # pass | warn | fail | skip
    message: str
    examples: tuple[str, ...] = ()


def finding(check: str, problems: list[str], passed: str, failed: str, status: str = "fail") -> Finding:
    """Passed with `passed` when there are no problems, else `status` with their count and the first few."""
    if not problems:
        return Finding(check, "pass", passed)
    return Finding(check, status, f"{len(problems)} {failed}", tuple(problems[:EXAMPLES]))
