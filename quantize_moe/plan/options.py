"""What the user asked of a run (`Options`), before `make_plan` resolves `auto` for a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9


@dataclass(frozen=True)
class Options:
    """What the user asked for; `make_plan` resolves `auto` scheme and format per checkpoint and
    `Plan.options` carries the resolved choice."""

    experts_only: bool = False
    scheme: str = AUTO
    format: str = AUTO
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    adapter: str | None = None  # "generic": the generic adapter instead of the model_type's family
