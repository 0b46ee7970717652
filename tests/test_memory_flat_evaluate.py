"""`evaluate` streams both models one decoder layer at a time: its peak anonymous memory (RssAnon, polled
from /proc) does not grow with the number of layers (issue 17). A test of memory, not of timings."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import bench_evaluate  # noqa: E402
import make_synthetic_mixtral  # noqa: E402
from process_memory import run_measured  # noqa: E402

from quantize_moe.plan.options import Options  # noqa: E402
from quantize_moe.write.job import quantize_checkpoint  # noqa: E402

SHAPE = dict(hidden=512, expert_width=4096, experts=8)  # about 100 MB of bf16 per layer


def _peak_anon_of_evaluate(folder: Path, layers: int) -> int:
    src, dst, ids = folder / "bf16", folder / "fp8", folder / "ids.safetensors"
    make_synthetic_mixtral.write_checkpoint(src, layers, vocab=256, shard_bytes=200_000_000)
    quantize_checkpoint(src, dst, Options(scheme="channel"), show_progress=False)
    save_file({"input_ids": torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))}, ids)
    return run_measured(bench_evaluate.CLI + ["evaluate", str(src), str(dst), "--data", str(ids), "--min-top1", "0",
                                              "--max-kl", "100", "--max-perplexity-ratio", "100"])["peak_rss_anon"]


@pytest.mark.slow
def test_evaluate_memory_stays_flat_as_layers_are_added(tmp_path):
    make_synthetic_mixtral.set_shape(**SHAPE)
    try:
        one_layer = bench_evaluate.layer_bytes()
        small = _peak_anon_of_evaluate(tmp_path / "small", layers=2)
        large = _peak_anon_of_evaluate(tmp_path / "large", layers=4)
    finally:
        make_synthetic_mixtral.set_shape(4096, 14336, 8)
    # Holding the layers it has run would add two layers of each model (four layers' bytes); a few MB per
    # layer of allocator and oneDNN caches stay.
    assert large - small < one_layer, (small, large, one_layer)
