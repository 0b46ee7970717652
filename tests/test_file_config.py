"""config.json is read without the family's transformers configuration module unless a field needs it
(issue 18: on transformers 5.17 importing it imports the modeling stack, seconds per command), and
reads exactly as the family's own config class reads it."""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys

import pytest
from transformers import CONFIG_MAPPING

from quantize_moe.adapters import adapter_for, parse_config
from quantize_moe.adapters.file_config import FileConfig, class_names
from quantize_moe.plan.options import Options
from quantize_moe.plan.plan import make_plan
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.tiny import TINY_CONFIGS

MISSING = object()
LAYER_NAMES = [f"{prefix}.{i}.x" for prefix in ("model.layers", "transformer.blocks") for i in range(8)]


def _saved_config(model_type: str) -> dict:
    """config.json as save_pretrained writes it: fields equal to the class defaults left out."""
    return json.loads(CONFIG_MAPPING[model_type](**TINY_CONFIGS[model_type]).to_json_string(use_diff=True))


def _class_config(raw: dict):
    config_class = CONFIG_MAPPING[raw["model_type"]]
    return config_class.from_dict(config_class._decode_special_floats(raw))


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_every_family_reads_as_its_config_class(model_type):
    raw = _saved_config(model_type)
    family = adapter_for(raw)
    ours, theirs = parse_config(raw, family, "config.json", LAYER_NAMES), _class_config(raw)
    assert isinstance(ours, FileConfig)
    assert family.moe_layers(ours) == family.moe_layers(theirs)
    assert family.mtp_layers(ours) == family.mtp_layers(theirs)
    assert [family.routing_rule(ours, {}, i.layer) for i in family.moe_layers(ours)] == \
        [family.routing_rule(theirs, {}, i.layer) for i in family.moe_layers(theirs)]
    # Every field, alias and property the class has, read alike (class-level settings such as tp plans
    # and attribute_map itself are the generic class's own; a tuple default reads back as a list).
    for name in sorted(set(class_names(model_type) or ()) | set(raw)):
        static = inspect.getattr_static(theirs, name, None)
        if name.startswith("_") or callable(static) or name not in vars(theirs) and not isinstance(static, property):
            continue
        mine, want = getattr(ours, name, MISSING), getattr(theirs, name, MISSING)
        assert mine == want or isinstance(want, tuple) and mine == list(want), name


def test_a_defaulted_field_left_out_reads_as_the_class_default():
    """Qwen2-MoE's decoder_sparse_step and num_experts_per_tok written as their defaults, or left out."""
    defaults = CONFIG_MAPPING["qwen2_moe"]()
    complete = {**_saved_config("qwen2_moe"), "decoder_sparse_step": defaults.decoder_sparse_step,
                "num_experts_per_tok": defaults.num_experts_per_tok}
    left_out = {k: v for k, v in complete.items() if k not in ("decoder_sparse_step", "num_experts_per_tok")}
    family = adapter_for(complete)
    layers = family.moe_layers(parse_config(complete, family, "config.json", LAYER_NAMES))
    assert family.moe_layers(parse_config(left_out, family, "config.json", LAYER_NAMES)) == layers
    assert [info.top_k for info in layers] == [defaults.num_experts_per_tok] * 2


def test_a_checkpoint_whose_config_leaves_defaults_out_plans_as_before(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen2_moe", num_experts_per_tok=CONFIG_MAPPING["qwen2_moe"]().num_experts_per_tok)
    folder = tmp_path / "left-out"
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    for name in ("decoder_sparse_step", "num_experts_per_tok"):
        del config[name]
    (folder / "config.json").write_text(json.dumps(config))
    before, after = make_plan(Checkpoint(src), Options()), make_plan(Checkpoint(folder), Options())
    assert (after.moe_layers, after.decisions, after.items) == (before.moe_layers, before.decisions, before.items)


def test_the_plan_of_a_complete_config_imports_no_family_configuration_module(tiny_checkpoint):
    """Mixtral's config.json holds every field its plan reads: transformers' configuration_mixtral (and,
    through it on transformers 5.17, the modeling stack) is never imported."""
    src = tiny_checkpoint("mixtral")
    code = ("import json, sys\nfrom quantize_moe.source.checkpoint import Checkpoint\n"
            "from quantize_moe.plan.plan import make_plan\n"
            f"make_plan(Checkpoint({str(src)!r}))\nprint(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "transformers.models.mixtral.configuration_mixtral" not in imported
    assert "transformers.models.auto.modeling_auto" not in imported


def test_a_nested_object_the_class_does_not_declare_reads_as_the_class_keeps_it():
    raw = {**_saved_config("mixtral"), "extra_settings": {"a": 1}}
    config = parse_config(raw, adapter_for(raw), "config.json", LAYER_NAMES)
    assert config.extra_settings == _class_config(raw).extra_settings == {"a": 1}
    assert not hasattr(config, "moe_intermediate_size")  # neither the file nor MixtralConfig has it
