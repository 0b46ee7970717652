"""Issue 19's second round of bad inputs, one test (or case list) per class: config fields of the wrong
type, a quantization_config that does not match the tensors, leftover scales, damaged FP8 scales on the
way back to bf16, round trips through our own outputs, `--overwrite` beside a user's files, and messages
for unreadable shards, a full disk and a mistyped local path. Each refusal is one sentence, exit 1, and
leaves nothing that looks complete."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantize_moe.source.locations import CONFIG_NAME, INDEX_NAME
from quantize_moe.write.destination import MANIFEST_NAME, RUN_FILES, RUN_RECORD
from robust_checks import SHARD_SIZE, assert_refused, mixtral_src, run_cli, snapshot, src  # noqa: F401
from test_bad_inputs import EXPERT, edit_config, edit_tensor, shard_of

ARGS = ("--max-shard-size", SHARD_SIZE, "--no-progress")
FP8_TENSOR = ("--format", "fp8", "--scheme", "tensor")
SCALE = "model.layers.1.block_sparse_moe.experts.2.w2.weight_scale"


def refused_before_writing(src: Path, dst: Path, *fragments: str, args=ARGS) -> None:
    before = snapshot(src)
    assert_refused(run_cli("quantize", src, dst, *args), *fragments)
    assert snapshot(src) == before and not dst.exists()


@pytest.mark.parametrize("edit, fragments", [
    (lambda c: c.update(text_config=5), ["field 'text_config' is 5"]),
    (lambda c: c.update(num_nextn_predict_layers="1"), ["field 'num_nextn_predict_layers' is '1'"]),
    (lambda c: c.update(num_local_experts="8"), ["num_local_experts", "expected int"]),
    (lambda c: c.update(num_hidden_layers={"x": [1, {"y": None}]}), ["num_hidden_layers"]),
    (lambda c: c.update(num_experts_per_tok=9), ["pick 9 experts", "num_experts_per_tok", "which has 4"]),
    (lambda c: c.update(num_experts_per_tok=0), ["pick 0 experts"]),
    (lambda c: c.update(quantization_config="fp8"), ["quantization_config that is str"]),
    (lambda c: c.update(quantization_config={"quant_method": "compressed-tensors", "config_groups": [1]}),
     ["quantization_config.config_groups", "not an object"]),
], ids=["text_config int", "undeclared field str", "declared field str", "nested garbage", "top_k above experts",
        "top_k zero", "quantization_config str", "config_groups list"])
def test_config_fields_of_the_wrong_type_are_one_sentence(src, tmp_path, edit, fragments):
    edit_config(src, edit)
    refused_before_writing(src, tmp_path / "dst", CONFIG_NAME, *fragments)


def test_top_k_above_the_expert_count_is_refused_by_validate_too(mixtral_src, src, tmp_path):  # noqa: F811
    dst = tmp_path / "dst"
    assert run_cli("quantize", mixtral_src, dst, *ARGS).exit_code == 0
    edit_config(src, lambda c: c.update(num_experts_per_tok=5))
    assert_refused(run_cli("validate", src, dst, "--no-progress", "--device", "cpu"), "pick 5 experts", "which has 4")


def test_quantization_config_over_bf16_weights_is_refused(src, tmp_path):
    edit_config(src, lambda c: c.update(quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"}))
    refused_before_writing(src, tmp_path / "dst", "quantization_config (fp8)", "no tensor of the checkpoint is FP8")
    assert_refused(run_cli("dequantize", src, tmp_path / "deq"), "no tensor of the checkpoint is FP8")
    assert not (tmp_path / "deq").exists()


@pytest.fixture
def fp8_out(mixtral_src, tmp_path) -> Path:  # noqa: F811
    """Our per-tensor native-FP8 output of the tiny Mixtral."""
    dst = tmp_path / "fp8"
    assert run_cli("quantize", mixtral_src, dst, *ARGS, *FP8_TENSOR).exit_code == 0
    return dst


def test_a_scale_beside_a_bf16_weight_is_refused(fp8_out, tmp_path):
    weight = SCALE.replace("weight_scale", "weight")
    edit_tensor(fp8_out, weight, lambda t: t.to(torch.bfloat16))
    assert_refused(run_cli("dequantize", fp8_out, tmp_path / "deq"), weight, "torch.bfloat16", SCALE)


def test_a_leftover_scale_in_a_bf16_source_is_refused_before_writing(src, tmp_path):
    leftover = EXPERT.replace(".weight", ".weight_scale")
    shard = shard_of(src, EXPERT)
    save_file({**load_file(shard), leftover: torch.ones(1)}, shard, metadata={"format": "pt"})
    index = json.loads((src / INDEX_NAME).read_text())
    index["weight_map"][leftover] = shard.name
    (src / INDEX_NAME).write_text(json.dumps(index))
    refused_before_writing(src, tmp_path / "dst", leftover, "leftover", EXPERT, args=(*ARGS, *FP8_TENSOR))


def set_scale(folder: Path, name: str, value) -> None:
    edit_tensor(folder, name, lambda t: value(t) if callable(value) else value)


@pytest.mark.parametrize("damage, fragments", [
    (lambda t: t * float("nan"), ["NaN, Inf, zero or negative"]),
    (lambda t: t * 0, ["NaN, Inf, zero or negative"]),
    (lambda t: -t, ["NaN, Inf, zero or negative"]),
    (lambda t: torch.ones(3), ["has shape (3,)", "need 1 values"]),
], ids=["NaN", "zero", "negative", "wrong shape"])
def test_dequantize_refuses_damaged_scales_naming_them(fp8_out, tmp_path, damage, fragments):
    set_scale(fp8_out, SCALE, damage)
    deq = tmp_path / "deq"
    assert_refused(run_cli("dequantize", fp8_out, deq), SCALE, *fragments)
    assert not (deq / CONFIG_NAME).exists() and not list(deq.glob("*.partial"))


@pytest.mark.parametrize("block", [[0, 128], [-1, 128], "128", None, [128]],
                         ids=["zero", "negative", "string", "null", "one number"])
def test_dequantize_refuses_a_bad_block_size(mixtral_src, tmp_path, block):  # noqa: F811
    dst = tmp_path / "fp8"
    assert run_cli("quantize", mixtral_src, dst, *ARGS, *FP8_TENSOR).exit_code == 0
    edit_config(dst, lambda c: c["quantization_config"].update(weight_block_size=block))
    result = run_cli("dequantize", dst, tmp_path / "deq")
    if block is None:  # no block size is per-tensor FP8 (AutoFP8), which this output is
        assert result.exit_code == 0, result.output
    else:
        assert_refused(result, "weight_block_size", "two positive whole numbers")


def test_validate_of_two_different_models_is_one_sentence(mixtral_src, tiny_checkpoint, tmp_path):  # noqa: F811
    other = tiny_checkpoint("mixtral", num_local_experts=6)
    dst = tmp_path / "dst"
    assert run_cli("quantize", other, dst, "--no-progress").exit_code == 0
    assert_refused(run_cli("validate", mixtral_src, dst, "--no-progress", "--device", "cpu"),
                   "MoE layer 0 has 4 experts", "6")
    qwen = tmp_path / "qwen"
    assert run_cli("quantize", tiny_checkpoint("qwen3_moe"), qwen, "--no-progress").exit_code == 0
    assert_refused(run_cli("validate", mixtral_src, qwen, "--no-progress", "--device", "cpu"),
                   "Mixtral checkpoint", "Qwen3-MoE")


def run_files(folder: Path) -> dict[str, str]:
    return {name: (folder / name).read_text() for name in RUN_FILES if (folder / name).is_file()}


def test_round_trip_through_dequantize_copies_none_of_our_run_files(mixtral_src, fp8_out, tmp_path):  # noqa: F811
    (fp8_out / "validation.json").write_text('{"layers": []}\n')
    deq, again = tmp_path / "deq", tmp_path / "again"
    assert run_cli("dequantize", fp8_out, deq).exit_code == 0
    assert not run_files(deq)  # the FP8 card, record and manifest describe the FP8 output only
    assert run_cli("quantize", deq, again, *ARGS).exit_code == 0
    assert set(run_files(again)) == {MANIFEST_NAME, RUN_RECORD, "README.md"}
    assert run_files(again)[RUN_RECORD] != run_files(fp8_out)[RUN_RECORD]
    result = run_cli("verify", again)
    assert result.exit_code == 0, result.output


def test_quantize_of_fp8_input_needs_requantize(fp8_out, tmp_path):
    again = tmp_path / "again"
    refused_before_writing(fp8_out, again, "already quantized (fp8)", "--requantize", args=ARGS)
    result = run_cli("quantize", fp8_out, again, *ARGS, "--requantize")
    assert result.exit_code == 0, result.output
    assert "rounded to FP8 again" in " ".join(result.output.split())
    assert "**Requantized** (`--requantize`)" in (again / "README.md").read_text()
    assert "--requantize" in json.loads((again / RUN_RECORD).read_text())["command"]
    assert json.loads((again / MANIFEST_NAME).read_text())["run"] != json.loads((fp8_out / MANIFEST_NAME).read_text())["run"]
    verified = run_cli("verify", again)
    assert verified.exit_code == 0, verified.output
    # asked for what it already is, there is nothing to do even with the option
    assert_refused(run_cli("quantize", fp8_out, tmp_path / "same", *ARGS, *FP8_TENSOR, "--requantize"),
                   "nothing to do")


def test_overwrite_leaves_files_that_are_not_ours(mixtral_src, fp8_out):  # noqa: F811
    adapter = fp8_out / "adapter_model.safetensors"
    save_file({"lora_A": torch.ones(2, 2)}, adapter)
    (fp8_out / "notes.txt").write_text("mine")
    stale = fp8_out / "model-00007-of-00009.safetensors"
    stale.write_bytes(b"an older run of ours")
    mine = {p.name: p.read_bytes() for p in (adapter, fp8_out / "notes.txt")}
    assert run_cli("quantize", mixtral_src, fp8_out, *ARGS, "--overwrite").exit_code == 0
    assert {name: (fp8_out / name).read_bytes() for name in mine} == mine
    assert not stale.exists()


def test_overwrite_never_follows_manifest_names_out_of_dst(mixtral_src, fp8_out, tmp_path):  # noqa: F811
    outside = tmp_path / "precious.txt"
    outside.write_text("keep")
    manifest = json.loads((fp8_out / MANIFEST_NAME).read_text())
    manifest["files"].update({"../precious.txt": {"size": 4, "digest": "x"}, str(outside): {"size": 4, "digest": "x"}})
    (fp8_out / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert run_cli("quantize", mixtral_src, fp8_out, *ARGS, "--overwrite").exit_code == 0
    assert outside.read_text() == "keep"


def test_unreadable_shard_is_named_as_unreadable(src, tmp_path, monkeypatch):
    shard = shard_of(src, EXPERT)
    if os.geteuid() == 0:  # root reads any file: simulate the refusal the kernel gives other users
        real_open = os.open
        monkeypatch.setattr(os, "open", lambda path, *a, **k: (_ for _ in ()).throw(PermissionError(
            errno.EACCES, "Permission denied", str(path))) if Path(path) == shard else real_open(path, *a, **k))
    else:
        shard.chmod(0)
    refused_before_writing(src, tmp_path / "dst", shard.name, "permission denied")


def test_a_full_disk_names_the_file_and_leaves_nothing_complete(mixtral_src, tmp_path, monkeypatch):  # noqa: F811
    from quantize_moe.write import shard_file

    real, calls = shard_file.write_all_at, []

    def write_all_at(fd, offset, view):
        calls.append(offset)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, view)

    monkeypatch.setattr(shard_file, "write_all_at", write_all_at)
    dst = tmp_path / "dst"
    text = assert_refused(run_cli("quantize", mixtral_src, dst, *ARGS, "--workers", "1"), "No space left on device")
    assert str(dst / "model-0000") in text and ".safetensors" in text
    assert not (dst / CONFIG_NAME).exists() and not list(dst.glob("*.partial"))


def test_a_full_disk_while_writing_config_names_it(mixtral_src, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(Path, "write_text", _failing_write_text(Path.write_text))
    dst = tmp_path / "dst"
    text = assert_refused(run_cli("quantize", mixtral_src, dst, *ARGS), "No space left on device")
    assert str(dst / CONFIG_NAME) in text
    assert not (dst / CONFIG_NAME).exists() and not list(dst.glob("*.partial"))


def _failing_write_text(real):
    def write_text(self, text, *args, **kwargs):
        if self.name == CONFIG_NAME + ".partial":
            real(self, text[: len(text) // 2], *args, **kwargs)  # half written when the disk fills
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, text, *args, **kwargs)
    return write_text


@pytest.mark.parametrize("typo", ["./models/mixtrl", "{tmp}/data/x", "models/mixtrl", "a/b/c"],
                         ids=["dot slash", "absolute", "org is a local folder", "two slashes"])
def test_a_mistyped_local_path_says_there_is_no_such_folder(tmp_path, monkeypatch, typo):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = typo.format(tmp=tmp_path)
    for command in (("quantize", path, "dst", "--no-progress"), ("inspect", path)):
        text = assert_refused(run_cli(*command), f"There is no folder named '{Path(path)}'")
        assert "Hub" not in text


def test_fp8_tensors_without_a_quantization_config_are_refused_everywhere(mixtral_src, fp8_out, tmp_path):  # noqa: F811
    edit_config(fp8_out, lambda c: c.pop("quantization_config"))
    for command in (("dequantize", fp8_out, tmp_path / "deq"),
                    ("validate", mixtral_src, fp8_out, "--no-progress", "--device", "cpu")):
        assert_refused(run_cli(*command), "torch.float8_e4m3fn", "has no quantization_config")
    assert not (tmp_path / "deq").exists()


@pytest.mark.parametrize("link", ["dangling", "outside"])
def test_every_file_read_or_copied_follows_one_link_rule(src, tmp_path, link):
    target = tmp_path / ("gone.json" if link == "dangling" else "secret.json")
    if link == "outside":
        target.write_text("{}")
    (src / "tokenizer_config.json").symlink_to(target)
    refused_before_writing(src, tmp_path / "dst", "tokenizer_config.json",
                           "loops or leads nowhere" if link == "dangling" else "links outside")


@pytest.mark.parametrize("qc", ["fp8", {"quant_method": "fp8", "weight_block_size": [0, 128]},
                                {"quant_method": "compressed-tensors", "config_groups": {"group_0": 5}}],
                         ids=["string", "zero block", "group not an object"])
def test_verify_reports_a_damaged_quantization_config_as_a_finding(fp8_out, qc):
    edit_config(fp8_out, lambda c: c.update(quantization_config=qc))
    result = run_cli("verify", fp8_out, "--json")
    assert result.exit_code == 3, result.output
    report = json.loads(result.output)
    assert any(f["check"] == "metadata" and "quantization_config" in f["message"] for f in report["findings"])


def test_a_block_checkpoint_without_its_block_size_is_one_sentence(tmp_path):
    from quantize_moe.source.tiny import build_tiny_checkpoint, to_block_fp8

    block = to_block_fp8(build_tiny_checkpoint("deepseek_v3", tmp_path / "bf16"), tmp_path / "block", (32, 32))
    edit_config(block, lambda c: c["quantization_config"].pop("weight_block_size"))
    assert_refused(run_cli("dequantize", block, tmp_path / "deq"), "weight_scale' is missing")
    assert not (tmp_path / "deq" / CONFIG_NAME).exists()


def test_the_generic_adapter_reads_counts_through_the_same_typed_access(src, tmp_path):
    edit_config(src, lambda c: c.update(model_type="my_moe", num_experts_per_tok="2"))
    refused_before_writing(src, tmp_path / "dst", CONFIG_NAME, "field 'num_experts_per_tok' is '2'",
                           args=(*ARGS, "--adapter", "generic"))
