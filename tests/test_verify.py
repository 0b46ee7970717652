"""`quantize-moe verify`: a good checkpoint passes; each kind of damage fails the check that owns it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from static_checkpoint import edit_shards

from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.cli.app import app
from quantize_moe.write.destination import MANIFEST_NAME
from quantize_moe.plan.options import Options
from quantize_moe.write.job import quantize_checkpoint
from quantize_moe.source.tiny import build_tiny_checkpoint
from quantize_moe.check.verify import verify
from quantize_moe.errors import EXIT_BAD_INPUT as EXIT_UNREADABLE, EXIT_CHECK_FAILED as EXIT_FAILED, EXIT_OK

EXPERT = "model.layers.0.block_sparse_moe.experts.1"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    build_tiny_checkpoint("mixtral", root / "src")
    # per-tensor native fp8: the damage below edits per-tensor scales and `ignored_layers`
    quantize_checkpoint(root / "src", root / "dst", Options(format="fp8", scheme="tensor", max_shard_size=200_000),
                        show_progress=False)
    return root / "src", root / "dst"


@pytest.fixture
def damaged(pair, tmp_path):
    """A copy of the good output to break."""
    return shutil.copytree(pair[1], tmp_path / "dst")


def edit_tensors(folder, edit):
    """Rewrite the shard holding EXPERT's weights after `edit(tensors)`; keeps the index consistent."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    edit_shards(folder, edit, [index["weight_map"][f"{EXPERT}.w1.weight"]])


def failed(report) -> dict[str, str]:
    return {f.check: " ".join([f.message, *f.examples]) for f in report.findings if f.status == "fail"}


def test_good_output_passes_every_check(pair):
    report = verify(pair[1], Checkpoint(pair[0]))
    assert report.ok and report.exit_code == EXIT_OK
    assert {f.check for f in report.findings} >= {"structure", "metadata", "scales", "shared scales", "coverage",
                                                   "integrity", "numerics: experts", "numerics: other tensors"}


def test_cli_json_and_exit_codes(pair, damaged, tmp_path):
    ok = CliRunner().invoke(app, ["verify", str(pair[1]), "--json"])
    assert ok.exit_code == EXIT_OK and json.loads(ok.stdout)["ok"] is True
    (damaged / "model-00001-of-00002.safetensors").open("ab").write(b"junk")
    bad = CliRunner().invoke(app, ["verify", str(damaged), "--json"])
    assert bad.exit_code == EXIT_FAILED and json.loads(bad.stdout)["exit_code"] == EXIT_FAILED
    missing = CliRunner().invoke(app, ["verify", str(tmp_path / "absent")])
    assert missing.exit_code == EXIT_UNREADABLE and "does not exist" in missing.output


def test_nan_and_zero_scales_fail(damaged):
    def edit(t):
        t[f"{EXPERT}.w1.weight_scale"] = torch.tensor(float("nan"))
        t[f"{EXPERT}.w2.weight_scale"] = torch.tensor(0.0)
    edit_tensors(damaged, edit)
    problems = failed(verify(damaged))
    assert "NaN" in problems["scales"] and "zero or negative" in problems["scales"]


def test_gate_and_up_with_different_scales_fail(damaged):
    edit_tensors(damaged, lambda t: t.__setitem__(f"{EXPERT}.w3.weight_scale", t[f"{EXPERT}.w3.weight_scale"] * 2))
    assert "different scales" in failed(verify(damaged))["shared scales"]


def test_an_expert_left_in_bf16_fails_coverage_and_metadata(damaged):
    def edit(t):
        t[f"{EXPERT}.w2.weight"] = t[f"{EXPERT}.w2.weight"].float().bfloat16()
        del t[f"{EXPERT}.w2.weight_scale"]
    edit_tensors(damaged, edit)
    problems = failed(verify(damaged))
    assert f"{EXPERT}.w2.weight" in problems["coverage"]
    assert f"{EXPERT}.w2" in problems["metadata"]  # a bf16 Linear not in ignored_layers


def test_ignore_list_that_disagrees_with_the_tensors_fails(damaged):
    config = json.loads((damaged / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = ["lm_head", f"{EXPERT}.w1", "model.layers.9.mlp.gate"]
    (damaged / "config.json").write_text(json.dumps(config))
    problems = failed(verify(damaged))["metadata"]
    assert f"'{EXPERT}.w1' is FP8 but listed" in problems
    assert "block_sparse_moe.gate' stays" in problems and "names no module" in problems


def set_ignored(folder, entries):
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = entries
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("entry, fragment", [
    ("re:(.+)+X$", "exponential time"),  # catastrophic backtracking: would hang the matcher
    ("re:(a|ab)*c", "exponential time"),
    ("re:.*.*.*.*.*x", "unbounded repeats"),
    ("re:model.[", "not a valid regular expression"),
    (5, "must be a list of module names"),
])
def test_a_hostile_or_broken_ignore_entry_is_named_not_run(damaged, entry, fragment):
    set_ignored(damaged, ["lm_head", entry])
    result = CliRunner().invoke(app, ["verify", str(damaged)], catch_exceptions=False)
    text = " ".join(result.output.split())
    assert result.exit_code == EXIT_UNREADABLE and fragment in text and "config.json" in text, result.output
    assert "Traceback" not in result.output


def test_an_ignore_entry_naming_a_non_linear_module_passes(damaged):
    """llm-compressor's model_free_ptq lists model.embed_tokens, which holds tensors but is no Linear."""
    config = json.loads((damaged / "config.json").read_text())
    set_ignored(damaged, [*config["quantization_config"]["ignored_layers"], "model.embed_tokens"])
    assert "metadata" not in failed(verify(damaged))
    set_ignored(damaged, [*config["quantization_config"]["ignored_layers"], "model.no_such_module"])
    assert "names no module" in failed(verify(damaged))["metadata"]


def test_index_metadata_that_is_not_an_object_is_a_failure_not_a_crash(damaged):
    index_path = damaged / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"] = "oops"
    index_path.write_text(json.dumps(index))
    assert "metadata is not an object" in failed(verify(damaged))["structure"]


def test_an_orphan_shard_fails_structure(damaged):
    shutil.copy(damaged / "model-00001-of-00002.safetensors", damaged / "model-00009-of-00009.safetensors")
    assert "model-00009-of-00009.safetensors" in failed(verify(damaged))["structure"]


def test_leftovers_fail_structure(damaged):
    (damaged / "config.json.partial").write_text("{}")
    assert "half-written" in failed(verify(damaged))["structure"]


def test_manifest_hashes_are_checked(damaged):
    shard = damaged / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes: only the hash sees it
    shard.write_bytes(bytes(data))
    assert "model-00002-of-00002.safetensors" in failed(verify(damaged))["integrity"]


def test_an_unfinished_run_fails_integrity(damaged):
    manifest = json.loads((damaged / MANIFEST_NAME).read_text())
    (damaged / MANIFEST_NAME).write_text(json.dumps(manifest | {"complete": False}))
    assert "did not finish" in failed(verify(damaged))["integrity"]


def test_the_cli_reports_the_integrity_check_it_started_first_in_its_place(damaged):
    """`verify` hashes DST before importing the other checks; the finding stays where it was."""
    shard = damaged / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = CliRunner().invoke(app, ["verify", str(damaged), "--json"])
    findings = json.loads(result.stdout)["findings"]
    assert [f["check"] for f in findings] == ["structure", "metadata", "scales", "shared scales", "coverage",
                                              "integrity", "numerics"]
    assert findings[5]["status"] == "fail" and shard.name in " ".join(findings[5]["examples"])


def test_a_damaged_manifest_is_a_finding_and_one_naming_a_file_outside_dst_an_error(damaged):
    (damaged / MANIFEST_NAME).write_text("{")
    result = CliRunner().invoke(app, ["verify", str(damaged), "--json"])
    integrity = next(f for f in json.loads(result.stdout)["findings"] if f["check"] == "integrity")
    assert result.exit_code == EXIT_FAILED and "is damaged" in integrity["message"]
    (damaged / MANIFEST_NAME).write_text(json.dumps({"run": "x", "complete": True, "files": {
        "../outside.json": {"size": 2, "digest": "x"}}}))
    result = CliRunner().invoke(app, ["verify", str(damaged)])
    assert result.exit_code == EXIT_UNREADABLE and "outside the checkpoint folder" in " ".join(result.output.split())


def test_numerics_against_the_source_catch_a_wrong_weight(pair, damaged):
    edit_tensors(damaged, lambda t: t.__setitem__(f"{EXPERT}.w1.weight",
                                                  (t[f"{EXPERT}.w1.weight"].float() * 1.5).to(torch.float8_e4m3fn)))
    (damaged / MANIFEST_NAME).unlink()  # as another tool's output: the hash check would stop it earlier
    report = verify(damaged, Checkpoint(pair[0]))
    assert "layer 0" in failed(report)["numerics: experts"]
    assert failed(report).keys() == {"numerics: experts"}


def test_a_missing_shard_is_a_failure_not_a_crash(damaged):
    (damaged / "model-00002-of-00002.safetensors").unlink()
    assert "missing" in failed(verify(damaged))["structure"]


@pytest.mark.parametrize("family", ["granitemoe", "dbrx", "deepseek_v2", "qwen3_next"])
def test_every_layout_passes_and_a_fused_gate_up_scale_mismatch_fails(family, tmp_path):
    """Fused expert tensors (GraniteMoE [E, 2I, H], DBRX flat w1/v1/w2), MLA and hybrid layers."""
    build_tiny_checkpoint(family, tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "dst", Options(), show_progress=False)
    report = verify(tmp_path / "dst", Checkpoint(tmp_path / "src"))
    assert report.ok, failed(report)
    if family == "granitemoe":
        shard = tmp_path / "dst" / "model.safetensors"
        tensors = load_file(shard)
        name = next(n for n in tensors if n.endswith("input_linear.weight_scale"))
        tensors[name][:, 1] *= 2  # up's scale no longer gate's
        save_file(tensors, shard, metadata={"format": "pt"})
        assert "different scales" in failed(verify(tmp_path / "dst"))["shared scales"]


def test_llama4_written_per_expert_passes_against_its_fused_source_and_a_missing_expert_fails(tmp_path):
    """verify --against maps SRC's fused Llama-4 experts onto the per-expert Linears written for them."""
    build_tiny_checkpoint("llama4_text", tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "dst", Options(), show_progress=False)
    assert verify(tmp_path / "dst", Checkpoint(tmp_path / "src")).ok
    shard = tmp_path / "dst" / "model.safetensors"
    expert = "model.layers.1.feed_forward.experts.2.up_proj"
    tensors = load_file(shard)
    del tensors[f"{expert}.weight"], tensors[f"{expert}.weight_scale"]
    save_file(tensors, shard, metadata={"format": "pt"})
    problems = failed(verify(tmp_path / "dst", Checkpoint(tmp_path / "src")))
    assert f"'{expert}.weight'" in problems["structure"] and "expert 2 w3 is missing" in problems["coverage"]


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_the_weight_check_on_validate_s_loaded_layers_equals_the_chunked_one(block_friendly, tmp_path, scheme):
    """On a GPU, verify --against compares the experts on the layers validate loaded (one read of each);
    that must give what the weight check's own chunked loading gives, a damaged expert included."""
    from quantize_moe.check.validate import validate
    from quantize_moe.check.weights import check_expert_weights, layer_weight_check

    src, dst = block_friendly("mixtral"), tmp_path / "fp8"
    quantize_checkpoint(src, dst, Options(scheme=scheme), show_progress=False)
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    edit_shards(dst, lambda tensors: name in tensors and tensors.update(
        {name: (tensors[name].float() * 1.5).to(tensors[name].dtype)}))
    loaded = []
    validate(src, dst, tokens=16, device="cpu",
             on_loaded=lambda layer, original, quantized: loaded.append(layer_weight_check(layer, original, quantized)))
    chunked = check_expert_weights(src, dst, device="cpu")
    assert [c.layer for c in loaded] == [c.layer for c in chunked]
    for mine, theirs in zip(loaded, chunked):
        assert mine.relative_error == pytest.approx(theirs.relative_error, rel=1e-6)
        assert mine.worst_bound_ratio == pytest.approx(theirs.worst_bound_ratio, rel=1e-6)
    assert [c.ok for c in loaded] == [c.layer != 1 for c in loaded]
