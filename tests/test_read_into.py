"""`Checkpoint.read_into` fills a caller's tensor (a part of a stacked expert parameter) with exactly the
bytes `get` returns, from several threads at once, and says when it cannot (another dtype or size)."""

from concurrent.futures import ThreadPoolExecutor

import torch

from quantize_moe.check.moe_layers import MoECheckpoint
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.tiny import build_tiny_checkpoint


def test_parallel_reads_into_slices_equal_get(tmp_path):
    checkpoint = Checkpoint(build_tiny_checkpoint("mixtral", tmp_path / "m"))
    names = [n for n in checkpoint.tensors if ".experts." in n and n.endswith(".weight")]
    stacked = torch.zeros(len(names), checkpoint.tensors[names[0]].nbytes // 2, dtype=torch.bfloat16)
    targets = [row.view(checkpoint.tensors[n].shape) for n, row in zip(names, stacked)]
    assert all(checkpoint.readable_into(n, t) for n, t in zip(names, targets))
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(checkpoint.read_into, names, targets))
    for name, target in zip(names, targets):
        assert torch.equal(target, checkpoint.get(name))
    assert not checkpoint.readable_into(names[0], targets[0].float())
    assert not checkpoint.readable_into(names[0], stacked[:2])


def test_loaded_layer_equals_the_checkpoint_experts(tmp_path):
    folder = build_tiny_checkpoint("mixtral", tmp_path / "m")
    moe = MoECheckpoint.open(folder)
    layer = moe.load_layer(0)
    prefix = "model.layers.0.block_sparse_moe.experts"
    for expert in range(layer.num_experts):
        gate, up, down = (moe.checkpoint.get(f"{prefix}.{expert}.{w}.weight") for w in ("w1", "w3", "w2"))
        assert torch.equal(layer.w13_weight[expert], torch.cat([gate, up]))
        assert torch.equal(layer.w2_weight[expert], down)
