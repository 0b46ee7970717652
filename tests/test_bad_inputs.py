"""Every bad input is refused through the CLI with one sentence naming what is wrong and
what to do: exit code 1, no traceback, SRC unchanged byte for byte, nothing written
outside DST, and (for problems visible in metadata) nothing written at all."""

from __future__ import annotations

import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantize_moe.source.locations import CONFIG_NAME, INDEX_NAME
from robust_checks import SHARD_SIZE, assert_refused, mixtral_src, run_cli, snapshot, src  # noqa: F401

EXPERT = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
EXPERT_UP = "model.layers.0.block_sparse_moe.experts.0.w3.weight"
LAST_EXPERT = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
NORM = "model.layers.1.input_layernorm.weight"


def shard_of(src: Path, name: str) -> Path:
    return src / json.loads((src / INDEX_NAME).read_text())["weight_map"][name]


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def edit_tensor(src: Path, name: str, edit) -> None:
    path = shard_of(src, name)
    tensors = load_file(path)
    tensors[name] = edit(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})


def edit_weight_map(src: Path, edit) -> None:
    edit_json(src / INDEX_NAME, lambda index: edit(index["weight_map"]))


def edit_config(src: Path, edit) -> None:
    edit_json(src / CONFIG_NAME, edit)


def write(path: Path, text: str) -> None:
    path.write_text(text)


def truncate(src, tmp_path):
    path = shard_of(src, EXPERT)
    os.truncate(path, path.stat().st_size - 100)


def corrupt_header(src, tmp_path):
    path = shard_of(src, EXPERT)
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))


def duplicate_tensor(src, tmp_path):
    save_file({EXPERT: torch.zeros(96, 64, dtype=torch.bfloat16), "extra.weight": torch.zeros(2)},
              src / "model-extra.safetensors")
    edit_weight_map(src, lambda m: m.update({"extra.weight": "model-extra.safetensors"}))


def link_outside(src, tmp_path):
    path = shard_of(src, EXPERT)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(path, outside)
    path.symlink_to(outside)


def config_links_outside(src, tmp_path):
    outside = tmp_path / "secret.json"
    shutil.move(src / CONFIG_NAME, outside)
    (src / CONFIG_NAME).symlink_to(outside)


def shard_loops(src, tmp_path):
    path = shard_of(src, EXPERT)
    path.unlink()
    path.symlink_to(path.name)


def index_names_pickle(src, tmp_path):
    torch.save({"extra.weight": RunsCode(tmp_path / "code-ran")}, src / "extra.bin")
    edit_weight_map(src, lambda m: m.update({"extra.weight": "extra.bin"}))
    return ["--allow-pickle"]


def to_pickle(src: Path) -> dict:
    state = {}
    for shard in sorted(src.glob("*.safetensors")):
        state.update(load_file(shard))
        shard.unlink()
    (src / INDEX_NAME).unlink()
    return state


class RunsCode:
    """A pickle payload that would create a file if it were ever unpickled without weights_only."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def crafted_pickle(src, tmp_path):
    state = to_pickle(src)
    state[EXPERT] = RunsCode(tmp_path / "code-ran")
    torch.save(state, src / "pytorch_model.bin")
    return ["--allow-pickle"]


def nan_in(name):
    def damage(src, tmp_path):
        edit_tensor(src, name, lambda t: t.index_fill(t.dim() - 1, torch.tensor([3]), float("nan" if "w2" in name else "inf")))
        return ["--workers", "2"]  # two items in flight when the refusal comes
    return damage


def too_little_disk(monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))


# case id -> (damage(src, tmp_path) -> extra CLI args, fragments of the message, refused before writing)
CASES = {
    "truncated shard": (truncate, ["is truncated", "re-download"], True),
    "corrupt header": (corrupt_header, ["is not a readable safetensors file"], True),
    "missing shard": (lambda src, _: shard_of(src, EXPERT).unlink(), ["which is missing"], True),
    "tensor not in its shard": (
        lambda src, _: edit_weight_map(src, lambda m: m.update({EXPERT: m[LAST_EXPERT]})),
        [EXPERT, "does not hold it"], True),
    "same tensor in two shards": (duplicate_tensor, [EXPERT, "is stored twice"], True),
    "absolute path in index": (
        lambda src, _: edit_weight_map(src, lambda m: m.update({EXPERT: str(shard_of(src, EXPERT))})),
        ["outside the checkpoint folder"], True),
    "dot-dot in index": (
        lambda src, _: edit_weight_map(src, lambda m: m.update({EXPERT: "../" + m[EXPERT]})),
        ["outside the checkpoint folder"], True),
    "shard links outside": (link_outside, ["links outside the checkpoint folder"], True),
    "index not json": (lambda src, _: write(src / INDEX_NAME, "[]"),
                       ["not a valid safetensors index"], True),
    "config missing": (lambda src, _: (src / CONFIG_NAME).unlink(), ["config.json' is missing"], True),
    "config invalid": (lambda src, _: write(src / CONFIG_NAME, '{"model_type": '),
                       ["is not valid JSON"], True),
    "unknown family": (lambda src, _: edit_config(src, lambda c: c.update(model_type="llama")),
                       ["model_type 'llama'", "does not support", "pass --adapter generic",
                        "docs/adding-a-family.md"], True),
    "expert count": (lambda src, _: edit_config(src, lambda c: c.update(num_local_experts=8)),
                     ["declares 8 experts in layer 0", "holds 4"], True),
    "absurd layer count": (lambda src, _: edit_config(src, lambda c: c.update(num_hidden_layers=10 ** 9)),
                           ["declares 1000000000 decoder layers", "hold 2"], True),
    "fp8 tensors without config": (lambda src, _: edit_tensor(src, EXPERT, lambda t: t.to(torch.float8_e4m3fn)),
                                   [EXPERT, "float8_e4m3fn", "unquantized"], True),
    "quantized, no way back": (
        lambda src, _: edit_config(src, lambda c: c.update(quantization_config={"quant_method": "gptq"})),
        ["already quantized (gptq)", "cannot dequantize"], True),
    "quantization_config on bf16 weights": (
        lambda src, _: edit_config(src, lambda c: c.update(quantization_config={"quant_method": "fp8"}))
        or ["--format", "fp8", "--scheme", "tensor"],
        ["quantization_config (fp8)", "no tensor of the checkpoint is FP8"], True),
    "mixed dtypes in a scale group": (lambda src, _: edit_tensor(src, EXPERT_UP, lambda t: t.float()),
                                      [EXPERT_UP, "shares its scale", "torch.float32"], True),
    "config.json links outside SRC": (config_links_outside, [CONFIG_NAME, "links outside"], True),
    "FIFO shard": (lambda src, _: (shard_of(src, EXPERT).unlink(), os.mkfifo(shard_of(src, EXPERT))) and None,
                   ["is not a regular file"], True),
    "shard link loops": (shard_loops, ["loops or leads nowhere"], True),
    "safetensors index names a .bin": (index_names_pickle, ["extra.bin", "not a .safetensors file"], True),
    "deeply nested config.json": (lambda src, _: write(src / CONFIG_NAME, "[" * 100_000 + "]" * 100_000),
                                  [CONFIG_NAME, "nests JSON too deeply"], True),
    "deeply nested index": (lambda src, _: write(src / INDEX_NAME, '{"weight_map": ' + "[" * 100_000),
                            [INDEX_NAME, "nests JSON too deeply"], True),
    "pickle only": (lambda src, _: torch.save(to_pickle(src), src / "pytorch_model.bin"),
                    ["pytorch_model.bin", "--allow-pickle"], True),
    "crafted pickle": (crafted_pickle, ["pytorch_model.bin", "holds more than plain tensors"], True),
    "shard the index does not list": (
        lambda src, _: shutil.copy(shard_of(src, EXPERT), src / "model-00009-of-00009.safetensors") and [],
        ["model-00009-of-00009.safetensors", "does not list", "different saves"], True),
    "tensor the index does not list": (lambda src, _: edit_weight_map(src, lambda m: m.pop(EXPERT)),
                                       [EXPERT, "does not list", "different saves"], True),
    "NaN in an expert": (nan_in(LAST_EXPERT), [LAST_EXPERT, "NaN or Inf"], False),
    "Inf in a kept norm": (nan_in(NORM), [NORM, "NaN or Inf"], False),
}


@pytest.mark.parametrize("damage, fragments, preflight", CASES.values(), ids=CASES)
def test_bad_input_is_refused_cleanly(src, tmp_path, damage, fragments, preflight):
    extra_args = damage(src, tmp_path) or []
    dst = tmp_path / "dst"
    before_src, before_all = snapshot(src), snapshot(tmp_path)
    result = run_cli("quantize", src, dst, "--max-shard-size", SHARD_SIZE, "--no-progress", *extra_args)
    assert_refused(result, *fragments)
    assert snapshot(src) == before_src
    assert snapshot(tmp_path, skip=dst) == before_all
    if preflight:
        assert not dst.exists()
    else:  # found while reading data: DST is left unfinished, never looking complete
        assert not (dst / CONFIG_NAME).exists() and not list(dst.glob("*.partial"))


def test_too_little_free_disk_is_refused_before_writing(src, tmp_path, monkeypatch):
    too_little_disk(monkeypatch)
    dst = tmp_path / "dst"
    before = snapshot(tmp_path)
    assert_refused(run_cli("quantize", src, dst, "--no-progress"), "needs", "1.00 KB free")
    assert snapshot(tmp_path) == before


def dst_is_src(src, tmp_path):
    return src


def dst_inside_src(src, tmp_path):
    return src / "fp8"


def dst_contains_src(src, tmp_path):
    return tmp_path


def dst_not_empty(src, tmp_path):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "notes.txt").write_text("mine")
    return tmp_path / "dst"


def dst_is_file(src, tmp_path):
    (tmp_path / "dst").write_text("mine")
    return tmp_path / "dst"


@pytest.mark.parametrize("make_dst, args, fragments", [
    (dst_is_src, [], ["is SRC or inside it"]),
    (dst_inside_src, [], ["is SRC or inside it"]),
    (dst_contains_src, ["--overwrite"], ["is inside DST"]),
    (dst_not_empty, [], ["is not empty", "--overwrite"]),
    (dst_not_empty, ["--resume"], ["has no quantize-moe-manifest.json"]),
    (dst_is_file, [], ["is not a folder"]),
], ids=["DST is SRC", "DST inside SRC", "SRC inside DST", "DST not empty", "resume foreign DST", "DST is a file"])
def test_bad_destination_is_refused_before_writing(src, tmp_path, make_dst, args, fragments):
    dst = make_dst(src, tmp_path)
    before = snapshot(tmp_path)
    assert_refused(run_cli("quantize", src, dst, "--no-progress", *args), *fragments)
    assert snapshot(tmp_path) == before


def test_fp32_tensors_beside_bf16_are_kept_in_their_dtype(src, tmp_path):
    """A model may mix dtypes: a kept fp32 tensor stays fp32 bit for bit."""
    edit_tensor(src, NORM, lambda t: t.float() + 0.1)
    dst = tmp_path / "dst"
    assert run_cli("quantize", src, dst, "--max-shard-size", SHARD_SIZE, "--no-progress").exit_code == 0
    out = load_file(shard_of(dst, NORM))[NORM]
    assert out.dtype == torch.float32
    assert torch.equal(out, load_file(shard_of(src, NORM))[NORM])


def test_pickle_checkpoint_with_allow_pickle_gives_the_same_shards(mixtral_src, src, tmp_path):  # noqa: F811
    torch.save(to_pickle(src), src / "pytorch_model.bin")
    from_pickle, from_safetensors = tmp_path / "a", tmp_path / "b"
    args = ("--max-shard-size", SHARD_SIZE, "--no-progress")
    assert run_cli("quantize", src, from_pickle, "--allow-pickle", *args).exit_code == 0
    assert run_cli("quantize", mixtral_src, from_safetensors, *args).exit_code == 0
    shards = sorted(p.name for p in from_safetensors.glob("*.safetensors"))
    assert shards == sorted(p.name for p in from_pickle.glob("*.safetensors"))
    for name in shards:
        assert (from_pickle / name).read_bytes() == (from_safetensors / name).read_bytes()


def test_an_fp8_checkpoint_is_requantized_through_dequantize(mixtral_src, tmp_path):
    fp8, bf16, again = tmp_path / "fp8", tmp_path / "bf16", tmp_path / "again"
    assert run_cli("quantize", mixtral_src, fp8, "--no-progress").exit_code == 0
    assert_refused(run_cli("quantize", fp8, again, "--no-progress"), "nothing to do", "--requantize")
    assert run_cli("dequantize", fp8, bf16).exit_code == 0
    assert run_cli("quantize", bf16, again, "--no-progress").exit_code == 0


def test_a_source_card_with_broken_yaml_warns_and_the_run_completes(src, tmp_path):
    write(src / "README.md", "---\nlicense: [apache\n---\n# base\n")
    result = run_cli("quantize", src, tmp_path / "dst", "--max-shard-size", SHARD_SIZE, "--no-progress")
    assert result.exit_code == 0, result.output
    assert "not valid YAML" in " ".join(result.output.split())
    card = (tmp_path / "dst" / "README.md").read_text()
    assert "tags:" in card and "license" not in card.split("---")[1]
    assert run_cli("verify", tmp_path / "dst").exit_code == 0
