"""What the user asked of a run (`Options`), before `make_plan` resolves `auto` for a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
# The names of quantization.schemes.SCHEMES and quantization.formats.FORMATS (a test keeps them equal),
# here so that the command line offers them as choices without importing torch.
SCHEME_CHOICES = (AUTO, "tensor", "channel", "block")
FORMAT_CHOICES = (AUTO, "fp8", "compressed-tensors")
ACTIVATION_CHOICES = ("dynamic", "static")  # static: calibrated per-tensor input scales
KV_CACHE_CHOICES = ("fp8",)  # calibrated per-tensor k_scale / v_scale
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
    activations: str = "dynamic"  # "static": per-tensor input scales measured on calibration data
    kv_cache: str | None = None  # "fp8": per-tensor k_scale / v_scale of every attention layer, calibrated
    calibration: str | None = None  # the calibration data file (its tokens' digest is in the run fingerprint)
    calibration_samples: int | None = None  # sequences of it to use (default: all)
    calibration_length: int = 512  # tokens per sequence
    calibration_routed_only: bool = False  # experts measured on their routed tokens only

    @property
    def calibrates(self) -> bool:
        """Whether the run measures anything on calibration data (static activations, an FP8 KV cache)."""
        return self.activations == "static" or self.kv_cache is not None
