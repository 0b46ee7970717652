"""`evaluate` and calibration stream the model one decoder layer at a time (`evaluate` both models): their
peak anonymous memory (RssAnon, polled from /proc) does not grow with the number of layers, and loading a
layer, or calibrating over it, holds little more than the layer (issue 17). A test of memory, not of
timings."""

import subprocess
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


def _synthetic(folder: Path, layers: int) -> tuple[Path, Path]:
    """A bf16 checkpoint of `layers` layers in `folder`, and 2 x 32 token ids beside it."""
    src, ids = folder / "bf16", folder / "ids.safetensors"
    make_synthetic_mixtral.write_checkpoint(src, layers, vocab=256, shard_bytes=200_000_000)
    save_file({"input_ids": torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))}, ids)
    return src, ids


def _peak_anon_of_evaluate(folder: Path, layers: int) -> int:
    (src, ids), dst = _synthetic(folder, layers), folder / "fp8"
    quantize_checkpoint(src, dst, Options(scheme="channel"), show_progress=False)
    return run_measured(bench_evaluate.CLI + ["evaluate", str(src), str(dst), "--data", str(ids), "--min-top1", "0",
                                              "--max-kl", "100", "--max-perplexity-ratio", "100"])["peak_rss_anon"]


def _peak_anon_of_calibration(folder: Path, layers: int) -> int:
    """The calibration `quantize --activations static` runs (the model with its hooks), without the pipeline."""
    src, ids = _synthetic(folder, layers)
    return run_measured(bench_evaluate.CALIBRATE + [str(src), str(ids), "32", "cpu"])["peak_rss_anon"]


@pytest.mark.slow
@pytest.mark.parametrize("peak_anon", [_peak_anon_of_evaluate, _peak_anon_of_calibration],
                         ids=["evaluate", "calibration"])
def test_memory_stays_flat_as_layers_are_added(tmp_path, peak_anon):
    make_synthetic_mixtral.set_shape(**SHAPE)
    try:
        one_layer = bench_evaluate.layer_bytes()
        small = peak_anon(tmp_path / "small", layers=2)
        large = peak_anon(tmp_path / "large", layers=4)
    finally:
        make_synthetic_mixtral.set_shape(4096, 14336, 8)
    # Holding the layers it has run would add two layers of each model (four layers' bytes; two for
    # calibration's one model); a few MB per layer of allocator and oneDNN caches stay.
    assert large - small < one_layer, (small, large, one_layer)


# A fresh process (the pages of building the checkpoints would be reused and hide a peak) polling its RssAnon
# every millisecond into peak[0] once `poller` is started.
POLLING = """
import sys, threading, time, torch
from quantize_moe.adapters.reader import SourceReader
from quantize_moe.run.executor import LayerStreamedModel
from quantize_moe.source.checkpoint import Checkpoint

def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

peak, done = [0], threading.Event()

def poll():
    while not done.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.001)

poller = threading.Thread(target=poll)
"""

# While the first decoder layer is loaded and run, printed as bytes above the level before: the peak until
# the layer is loaded, then the peak of loading and running it.
FIRST_LAYER = POLLING + """
model = LayerStreamedModel(SourceReader(Checkpoint(sys.argv[1])))
layers = model.hidden_states([torch.zeros(2, 32, dtype=torch.long)])
before, loaded = rss_anon(), []
materialise = model._materialise

def measured(module, *args, **kwargs):
    materialise(module, *args, **kwargs)
    loaded.append(max(peak[0], rss_anon()))

model._materialise = measured
poller.start()
next(layers)
done.set()
poller.join()
print(loaded[-1] - before, peak[0] - before)
"""

# While calibration runs the model with its hooks, printed as bytes above the level once the meta model is
# built (the code and the meta model, fixed costs that weigh a whole 100 MB layer here, are left out).
CALIBRATION = POLLING + """
from quantize_moe.run.calibration import calibrate

streamed, before = LayerStreamedModel.hidden_states, []

def measured(self, batches):
    before.append(rss_anon())
    poller.start()
    yield from streamed(self, batches)

LayerStreamedModel.hidden_states = measured
calibrate(SourceReader(Checkpoint(sys.argv[1])), list(torch.randint(0, 256, (2, 1, 32))))
done.set()
poller.join()
print(peak[0] - before[0])
"""


@pytest.fixture(scope="module")
def one_layer_pair(tmp_path_factory):
    """(bf16, FP8) one-layer checkpoints of about 100 MB of bf16 per layer, and that layer's bytes."""
    folder = tmp_path_factory.mktemp("one-layer")
    make_synthetic_mixtral.set_shape(**SHAPE)
    try:
        make_synthetic_mixtral.write_checkpoint(folder / "bf16", 1, vocab=256, shard_bytes=200_000_000)
        one_layer = bench_evaluate.layer_bytes()
    finally:
        make_synthetic_mixtral.set_shape(4096, 14336, 8)
    quantize_checkpoint(folder / "bf16", folder / "fp8", Options(scheme="channel"), show_progress=False)
    return {"bf16": folder / "bf16", "fp8": folder / "fp8"}, one_layer


@pytest.mark.slow
@pytest.mark.parametrize("which", ["bf16", "fp8"])
def test_loading_a_layer_holds_little_more_than_the_layer(one_layer_pair, which):
    """Fused experts filled in place (run/placement.py) and large blocks returned to the system when freed:
    loading the first layer adds 1.00 (bf16) to 1.14 layers (FP8: its bytes and the dequantizing buffers
    of the reading threads) at the peak; transformers' loader stacking and concatenating them added 1.35-1.37.
    Running it too peaks at 1.34 layers with FP8 activations (the torch reference's float32 copy of one
    expert and its matmul's buffers), 1.04 with bf16."""
    folders, one_layer = one_layer_pair
    result = subprocess.run([sys.executable, "-c", FIRST_LAYER, str(folders[which])], capture_output=True,
                            text=True, check=True)
    load, run = (int(value) / one_layer for value in result.stdout.split()[-2:])
    assert load < 1.2, (load, run)
    assert run < 1.5, (load, run)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["bf16", "fp8"])
def test_calibrating_over_a_layer_holds_little_more_than_the_layer(one_layer_pair, which):
    """Calibration's hooks on top of running the layer: every Linear's input amax, and every expert's gate/up
    over every token (its w2 input's statistics) in batched matmuls of at most 32 MB of output on the
    experts' own bf16 weights, kept as one scalar per expert: measured 1.10 (bf16) and 1.32-1.42 (FP8: the
    torch reference's float32 copy of one expert while the layer runs, as loading and running it above,
    and about 0.2 layer, 20 MB, kept once per process after the first FP8 forward, MKL's buffers among
    them) layers above the level once the model is built. Float32 copies of the experts for the statistics
    measured 2.6."""
    folders, one_layer = one_layer_pair
    result = subprocess.run([sys.executable, "-c", CALIBRATION, str(folders[which])], capture_output=True,
                            text=True, check=True)
    peak = int(result.stdout.split()[-1]) / one_layer
    assert peak < 1.5, peak
