"""The pass/fail thresholds of `validate`, apart from it so the command line can show their defaults
without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    """Defaults pass a good per-tensor FP8 checkpoint (w8a8 error on real weights is ~3-7%) and fail a
    broken one (a wrong scale, swapped gate/up or a transposed expert gives errors near or above 1)."""

    max_relative_error: float = 0.15
    min_cosine: float = 0.99
    max_kernel_error: float = 0.03  # our path vs the float64 reference of the same weights
