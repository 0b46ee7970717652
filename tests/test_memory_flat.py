"""`verify --against`, `validate` and `dequantize` hold a few experts (or one layer) at a time: their peak
anonymous memory (RssAnon, polled from /proc; mapped shards count in RSS only) does not grow with the
number of layers, and for `verify --against` and `dequantize` not with the experts per layer either
(issue 18). A test of memory, not of timings."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import make_synthetic_mixtral  # noqa: E402
from process_memory import run_measured  # noqa: E402

from quantize_moe.plan.options import Options  # noqa: E402
from quantize_moe.write.job import quantize_checkpoint  # noqa: E402

# Small experts and a 1 MB chunk budget: one expert at a time, so a whole layer held at once would show.
CLI = ("import sys, quantize_moe.check.moe_layers as m; m.EXPERT_CHUNK_BYTES = 1 << 20; "
       "from quantize_moe.cli.app import app; app(sys.argv[1:])")
SIZES = {"small": (2, 4), "deep": (6, 4), "large": (6, 32)}  # (layers, experts per layer)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(bf16 source, FP8 output) of each size in SIZES."""
    made = {}
    for size, (layers, experts) in SIZES.items():
        folder = tmp_path_factory.mktemp(size)
        make_synthetic_mixtral.set_shape(hidden=256, expert_width=1024, experts=experts)
        try:
            make_synthetic_mixtral.write_checkpoint(folder / "bf16", layers, vocab=256, shard_bytes=50_000_000)
        finally:
            make_synthetic_mixtral.set_shape(4096, 14336, 8)
        quantize_checkpoint(folder / "bf16", folder / "fp8", Options(scheme="channel"), show_progress=False)
        made[size] = folder / "bf16", folder / "fp8"
    return made


def _peak_anon(*args: str) -> int:
    return run_measured([sys.executable, "-c", CLI, *map(str, args)])["peak_rss_anon"]


def _verify(src: Path, dst: Path) -> int:
    return _peak_anon("verify", dst, "--against", src)


def _validate(src: Path, dst: Path) -> int:
    return _peak_anon("validate", src, dst, "--no-progress", "--tokens", "16", "--device", "cpu")


def _dequantize(src: Path, dst: Path) -> int:
    return _peak_anon("dequantize", dst, dst.parent / "bf16-again", "--overwrite")


@pytest.mark.slow
@pytest.mark.parametrize("command, grown", [(_verify, "large"), (_dequantize, "large"), (_validate, "deep")],
                         ids=["verify --against", "dequantize", "validate"])
def test_peak_anonymous_memory_stays_flat_as_the_model_grows(checkpoints, command, grown):
    small, large = command(*checkpoints["small"]), command(*checkpoints[grown])
    assert large <= small * 1.15 + (48 << 20), (small, large)
