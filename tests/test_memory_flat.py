"""`verify --against` holds a few experts at a time: its peak anonymous memory (RssAnon, polled from
/proc; mapped shards count in RSS only) does not grow with the number of layers or experts (issue 18).
A test of memory, not of timings."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import make_synthetic_mixtral  # noqa: E402
from process_memory import run_measured  # noqa: E402

from quantize_moe.plan.options import Options  # noqa: E402
from quantize_moe.write.job import quantize_checkpoint  # noqa: E402

# Small experts and a 1 MB chunk budget: one expert at a time, so a whole layer held at once would show.
VERIFY = ("import sys, quantize_moe.check.moe_layers as m; m.EXPERT_CHUNK_BYTES = 1 << 20; "
          "from quantize_moe.cli.app import app; app(sys.argv[1:])")


def _peak_anon_of_verify(folder: Path, layers: int, experts: int) -> int:
    src, dst = folder / "bf16", folder / "fp8"
    make_synthetic_mixtral.set_shape(hidden=256, expert_width=1024, experts=experts)
    try:
        make_synthetic_mixtral.write_checkpoint(src, layers, vocab=256, shard_bytes=50_000_000)
    finally:
        make_synthetic_mixtral.set_shape(4096, 14336, 8)
    quantize_checkpoint(src, dst, Options(scheme="channel"), show_progress=False)
    return run_measured([sys.executable, "-c", VERIFY, "verify", str(dst), "--against", str(src)])["peak_rss_anon"]


@pytest.mark.slow
def test_verify_against_memory_stays_flat_as_the_model_grows(tmp_path):
    small = _peak_anon_of_verify(tmp_path / "small", layers=2, experts=4)
    large = _peak_anon_of_verify(tmp_path / "large", layers=6, experts=32)  # 8x the experts per layer
    assert large <= small * 1.15 + (48 << 20), (small, large)
