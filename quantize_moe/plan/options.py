"""What the user asked of a run (`Options`), before `make_plan` resolves `auto` for a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
# The names of quantization.schemes.SCHEMES and quantization.formats.FORMATS (a test keeps them equal),
# here so that the command line offers them as choices without importing torch.
SCHEME_CHOICES = (AUTO, "tensor", "channel", "block")
FORMAT_CHOICES = (AUTO, "fp8", "compressed-tensors")
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
# A GPU worker spends most of an item writing and waiting for the disk (quantizing takes milliseconds),
# so a device gets enough workers to keep several writes in flight: on an H200 machine, 6 workers wrote a
# 47 GB output in 40.1 s where 3 took 43.4 s (docs/performance.md).
GPU_WORKERS_PER_DEVICE = 6


@dataclass(frozen=True)
class Options:
    """What the user asked for; `make_plan` resolves `auto` scheme and format per checkpoint and
    `Plan.options` carries the resolved choice."""

    experts_only: bool = False
    scheme: str = AUTO
    format: str = AUTO
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    adapter: str | None = None  # "generic": the generic adapter instead of the model_type's family
    requantize: bool = False  # quantize a SRC that is already quantized (its weights are rounded twice)
