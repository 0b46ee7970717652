"""`quantize --activations static --calibration FILE`: the input scales written are amax/448 of what
transformers' own full-model forward feeds each Linear and each expert (measured here by independent
hooks), in each format's convention; transformers loads and applies them; bad input is one sentence."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging
from typer.testing import CliRunner

from quantize_moe.adapters import Kind
from quantize_moe.cli.app import app
from quantize_moe.plan.options import Options
from quantize_moe.plan.plan import make_plan
from quantize_moe.quantization.static import KV_SCALES
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.tiny import TINY_CONFIGS

runner = CliRunner()
IDS = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def quiet_transformers():
    transformers_logging.set_verbosity_error()


@pytest.fixture(scope="module")
def ids_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calibration") / "ids.safetensors"
    save_file({"input_ids": IDS}, path)
    return path


def _quantize(src, dst, data, *extra):
    return runner.invoke(app, ["quantize", str(src), str(dst), "--no-progress", "--activations", "static",
                               "--calibration", str(data), "--calibration-length", str(IDS.shape[1]), *extra])


@torch.no_grad()
def _reference_amax(src: Path) -> tuple[dict[str, float], dict[tuple[int, int, str], float]]:
    """Independent of quantize-moe's executor and hooks: transformers' full model over IDS at once, a
    hook on every Linear and on every MoE block's input; the experts' w13/w2 inputs computed from that
    input and the per-expert weights as stored on disk, every expert on every token."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    linears, blocks, hooks = {}, {}, []

    def keep(store, name, value):
        store[name] = max(store.get(name, 0.0), float(value.abs().amax()))

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(lambda m, a, name=name: keep(linears, name, a[0])))
        elif hasattr(module, "experts") and hasattr(module, "gate"):
            hooks.append(module.register_forward_pre_hook(
                lambda m, a, name=name: blocks.__setitem__(int(name.split(".")[2]), a[0].flatten(0, -2))))
    model(IDS)
    for hook in hooks:
        hook.remove()
    weights = {}
    plan = make_plan(Checkpoint(src), Options())
    for name, d in plan.decisions.items():
        if d.role.kind == Kind.ROUTED_EXPERT:
            weights[(d.role.layer, d.role.expert, d.role.shard_id)] = Checkpoint(src).get(name).to(torch.bfloat16)
    experts = {}
    for (layer, expert, _) in weights:
        x = blocks[layer]
        gate, up = x @ weights[(layer, expert, "w1")].T, x @ weights[(layer, expert, "w3")].T
        experts[(layer, expert, "w13")] = float(x.abs().amax())
        experts[(layer, expert, "w2")] = float((torch.nn.functional.silu(gate) * up).abs().amax())
    return linears, experts


@pytest.mark.parametrize("family,fmt", [("mixtral", "fp8"), ("qwen3_moe", "compressed-tensors"),
                                        ("qwen2_moe", "compressed-tensors")])
def test_every_input_scale_is_amax_over_448_of_transformers_forward(family, fmt, tiny_checkpoint, ids_file, tmp_path):
    src = tiny_checkpoint(family)
    result = _quantize(src, tmp_path / "dst", ids_file, "--format", fmt)
    assert result.exit_code == 0, result.output
    linears, experts = _reference_amax(src)
    plan = make_plan(Checkpoint(src), Options(format=fmt, scheme="tensor"))
    roles = {d.role.module: d.role for d in plan.decisions.values() if d.quantize}
    with safe_open(tmp_path / "dst" / "model.safetensors", "pt") as f:
        scales = {k.removesuffix(".input_scale"): f.get_tensor(k) for k in f.keys() if k.endswith(".input_scale")}
    assert scales.keys() == roles.keys()
    for module, scale in scales.items():
        role = roles[module]
        assert scale.shape == (() if fmt == "fp8" else (1,)), module
        assert scale.dtype == (torch.float32 if fmt == "fp8" else torch.bfloat16), module
        if role.kind == Kind.ROUTED_EXPERT:
            want = experts[(role.layer, role.expert, "w2" if role.shard_id == "w2" else "w13")] / 448
        else:
            want = linears[module] / 448
        assert abs(float(scale) - want) <= 0.01 * want, (module, float(scale), want)
    config = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    if fmt == "fp8":
        assert config["activation_scheme"] == "static"
    else:
        assert config["config_groups"]["group_0"]["input_activations"] == {
            "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor",
            "group_size": None}
    record = json.loads((tmp_path / "dst" / "quantize_moe_run.json").read_text())["calibration"]
    assert record["tokens"] == IDS.numel() and len(record["layers"]) == plan.config.num_hidden_layers
    assert "calibration tokens" in (tmp_path / "dst" / "README.md").read_text()


def test_routed_only_statistics_leave_no_expert_without_a_scale(tiny_checkpoint, ids_file, tmp_path):
    src = tiny_checkpoint("qwen3_moe")
    one = tmp_path / "one.safetensors"
    save_file({"input_ids": IDS[:1, :4]}, one)  # 4 tokens x top-2 cannot reach all 8 experts
    result = runner.invoke(app, ["quantize", str(src), str(tmp_path / "dst"), "--no-progress", "--activations",
                                 "static", "--calibration", str(one), "--calibration-length", "4",
                                 "--calibration-routed-only"])
    assert result.exit_code == 0, result.output
    layers = json.loads((tmp_path / "dst" / "quantize_moe_run.json").read_text())["calibration"]["layers"]
    assert any(row["experts_routed"] < row["experts"] for row in layers)
    scales = {k: float(v) for k, v in load_file(tmp_path / "dst" / "model.safetensors").items()
              if k.endswith("input_scale")}
    assert scales and all(torch.isfinite(torch.tensor(v)) and v > 0 for v in scales.values())


def test_transformers_applies_the_static_scales(tiny_checkpoint, ids_file, tmp_path):
    """compressed-tensors' default load in transformers fake-quantizes every Linear's input with our
    input_scale: close to bf16 with the calibrated scales, far off with scales 100x too small."""
    src = tiny_checkpoint("mixtral")
    assert _quantize(src, tmp_path / "dst", ids_file, "--format", "compressed-tensors").exit_code == 0

    @torch.no_grad()
    def logits(folder):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()(IDS).logits.float()

    bf16 = logits(src)
    error = lambda out: ((out - bf16).norm(dim=-1) / bf16.norm(dim=-1)).median()  # noqa: E731
    good = error(logits(tmp_path / "dst"))
    shard = tmp_path / "dst" / "model.safetensors"
    tensors = load_file(shard)
    save_file({k: v / 100 if k.endswith("input_scale") else v for k, v in tensors.items()}, shard,
              metadata={"format": "pt"})
    assert good < 0.2 and error(logits(tmp_path / "dst")) > 2 * good


def test_resume_refuses_other_calibration_data(tiny_checkpoint, ids_file, tmp_path):
    src = tiny_checkpoint("mixtral")
    assert _quantize(src, tmp_path / "dst", ids_file).exit_code == 0
    other = tmp_path / "other.safetensors"
    save_file({"input_ids": IDS.flip(0)}, other)
    result = _quantize(src, tmp_path / "dst", other, "--resume")
    assert result.exit_code == 1 and "different SRC, options" in result.output
    again = _quantize(src, tmp_path / "dst", ids_file, "--resume")
    assert again.exit_code == 0 and "calibrating" not in again.output  # every shard is finished already


def _data(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / ("data.txt" if kind in ("empty", "unreadable", "bad jsonl") else "data.safetensors")
    if kind == "empty":
        path.write_text("")
    elif kind == "unreadable":
        path.write_bytes(b"\xff\xfe\x00 not text")
    elif kind == "bad jsonl":
        path = tmp_path / "data.jsonl"
        path.write_text('{"text": "fine"}\n[1, 2]\n')
    elif kind == "not safetensors":
        path.write_bytes(b"not safetensors")
    elif kind == "short":
        save_file({"input_ids": IDS[:, :8].contiguous()}, path)
    elif kind == "few":
        save_file({"input_ids": IDS[:1]}, path)
    elif kind == "vocab":
        save_file({"input_ids": torch.full_like(IDS, 500)}, path)
    return path


@pytest.mark.parametrize("kind,extra,message", [
    ("missing", [], "does not exist"),
    ("empty", [], "is empty"),
    ("unreadable", [], "cannot be read as text"),
    ("bad jsonl", [], "is not a JSON object"),
    ("not safetensors", [], "not a readable safetensors"),
    ("short", [], "shorter than --calibration-length"),
    ("few", ["--calibration-samples", "2"], "fewer than --calibration-samples"),
    ("vocab", [], "outside the vocabulary"),
])
def test_bad_calibration_is_one_sentence_and_writes_nothing(kind, extra, message, tiny_checkpoint, ids_file,
                                                            tmp_path):
    data = ids_file if kind is None else _data(tmp_path, kind)
    result = _quantize(tiny_checkpoint("mixtral"), tmp_path / "dst", data, *extra)
    assert result.exit_code == 1 and message in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 3
    assert not (tmp_path / "dst").exists() or not any((tmp_path / "dst").iterdir())


@pytest.mark.parametrize("args,message", [
    (["--activations", "static"], "need --calibration FILE"),
    (["--kv-cache", "fp8"], "need --calibration FILE"),
    (["--calibration", "ids.safetensors"], "used by --activations static or --kv-cache fp8 only"),
    (["--activations", "static", "--calibration", "ids.safetensors", "--scheme", "channel"],
     "takes --scheme tensor only"),
    (["--activations", "static", "--calibration", "ids.safetensors", "--scheme", "block"],
     "takes --scheme tensor only"),
    (["--activations", "sometimes"], "--activations"),
    (["--kv-cache", "fp4", "--calibration", "ids.safetensors"], "--kv-cache"),
])
def test_calibration_options_that_contradict_are_usage_errors(args, message, tiny_checkpoint, tmp_path):
    """Checked before the calibration file is read (here it does not exist): exit 2, nothing written."""
    result = runner.invoke(app, ["quantize", str(tiny_checkpoint("mixtral")), str(tmp_path / "dst"), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "dst").exists()


def _with_tokenizer(src: Path, folder: Path) -> Path:
    """A copy of SRC with a word-level tokenizer of its 128-token vocabulary."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(src, folder)
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 128)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_text_is_tokenized_with_the_source_tokenizer(suffix, tiny_checkpoint, tmp_path):
    """The same tokens as text, as JSON lines and as input_ids give the same scales."""
    src = _with_tokenizer(tiny_checkpoint("mixtral"), tmp_path / "src")
    words = [" ".join(f"w{int(i)}" for i in row) for row in IDS.clamp(min=1)]
    data = tmp_path / f"data{suffix}"
    data.write_text(" ".join(words) if suffix == ".txt" else "\n".join(json.dumps({"text": w}) for w in words))
    ids = tmp_path / "ids.safetensors"
    save_file({"input_ids": IDS.clamp(min=1)}, ids)
    assert _quantize(src, tmp_path / "text", data).exit_code == 0
    assert _quantize(src, tmp_path / "ids", ids).exit_code == 0
    assert (tmp_path / "text" / "model.safetensors").read_bytes() == (tmp_path / "ids" / "model.safetensors").read_bytes()


@torch.no_grad()
def _reference_kv(src: Path) -> dict[str, float]:
    """amax of the keys and values vLLM caches, from transformers' full forward over IDS: each attention
    module's k_proj (then k_norm where the family has one) and rotary, and its v_proj, recomputed from the
    inputs a hook records, with the family's own apply_rotary_pos_emb."""
    import sys

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    seen, hooks = {}, []
    for name, module in model.named_modules():
        if name.endswith(".self_attn"):
            hooks.append(module.register_forward_pre_hook(
                lambda m, a, kw, name=name: seen.__setitem__(name, (m, kw)), with_kwargs=True))
    model(IDS)
    for hook in hooks:
        hook.remove()
    amax = {}
    for name, (attention, kwargs) in seen.items():
        hidden = kwargs["hidden_states"]
        shape = (*hidden.shape[:-1], -1, attention.head_dim)
        key = attention.k_proj(hidden).view(shape)
        key = (attention.k_norm(key) if hasattr(attention, "k_norm") else key).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        _, key = sys.modules[type(attention).__module__].apply_rotary_pos_emb(key, key, cos, sin)
        amax[f"{name}.k_scale"] = float(key.abs().amax())
        amax[f"{name}.v_scale"] = float(attention.v_proj(hidden).abs().amax())
    return amax


@pytest.mark.parametrize("family,fmt", [("mixtral", "fp8"), ("qwen3_moe", "compressed-tensors")])
def test_kv_cache_scales_are_amax_over_448_of_the_cached_keys_and_values(family, fmt, tiny_checkpoint, ids_file,
                                                                          tmp_path):
    src = tiny_checkpoint(family)
    result = runner.invoke(app, ["quantize", str(src), str(tmp_path / "dst"), "--no-progress", "--format", fmt,
                                 "--scheme", "tensor", "--kv-cache", "fp8", "--calibration", str(ids_file),
                                 "--calibration-length", str(IDS.shape[1])])
    assert result.exit_code == 0, result.output
    tensors = load_file(tmp_path / "dst" / "model.safetensors")
    assert not any(name.endswith("input_scale") for name in tensors)  # activations stay dynamic
    want = _reference_kv(src)
    got = {name: t for name, t in tensors.items() if name.endswith(("k_scale", "v_scale"))}
    assert got.keys() == want.keys() and len(got) == 2 * AutoModelForCausalLM.from_pretrained(src).config.num_hidden_layers
    for name, scale in got.items():
        assert scale.dtype == torch.float32 and scale.shape == ()
        assert abs(float(scale) - want[name] / 448) <= 0.01 * want[name] / 448, name
    config = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                         "symmetric": True}


@pytest.mark.parametrize("family,message", [
    ("deepseek_v3", "multi-head latent attention"),
    ("qwen3_next", "linear_attention layers"),
    ("jamba", "linear attention or Mamba mixers"),
    ("granitemoehybrid", "linear attention or Mamba mixers"),
])
def test_kv_cache_refuses_attention_vllm_does_not_scale(family, message, tiny_checkpoint, ids_file, tmp_path):
    result = runner.invoke(app, ["quantize", str(tiny_checkpoint(family)), str(tmp_path / "dst"), "--kv-cache", "fp8",
                                 "--calibration", str(ids_file), "--calibration-length", str(IDS.shape[1])])
    assert result.exit_code == 1 and message in result.output, result.output
    assert not (tmp_path / "dst").exists()


def _tiny_multimodal_llama4(folder: Path) -> Path:
    """Llama-4 as Meta ships it: the decoder under `language_model.`, a vision tower beside it."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)
    torch.manual_seed(0)
    config = Llama4Config(text_config=TINY_CONFIGS["llama4_text"], vision_config=vision)
    Llama4ForConditionalGeneration(config).save_pretrained(folder)  # float32: its rotary buffer is complex
    return folder


def test_kv_cache_scales_sit_beside_the_attention_of_a_multimodal_wrapper(ids_file, tmp_path):
    """The decoder's layers come from `text_config` and its attention's names from the checkpoint, where
    vLLM reads them (`model.layers.{i}.self_attn` and the top-level layer count were wrong here); the
    layer-streamed model cannot run the wrapper yet, which is one sentence and nothing written."""
    src = _tiny_multimodal_llama4(tmp_path / "src")
    plan = make_plan(Checkpoint(src), Options(kv_cache="fp8", calibration=str(ids_file)))
    assert [o.name for item in plan.items if not item.sources for o in item.outputs] == [
        f"language_model.model.layers.{layer}.self_attn.{kind}" for layer in (0, 1) for kind in KV_SCALES]
    result = runner.invoke(app, ["quantize", str(src), str(tmp_path / "dst"), "--kv-cache", "fp8", "--calibration",
                                 str(ids_file), "--calibration-length", str(IDS.shape[1])])
    assert result.exit_code == 1 and "cannot be run layer by layer" in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output and not (tmp_path / "dst").exists()


def test_sharded_static_output_indexes_every_calibrated_scale_and_verifies(tiny_checkpoint, ids_file, tmp_path):
    src = tiny_checkpoint("qwen3_moe")
    result = _quantize(src, tmp_path / "dst", ids_file, "--max-shard-size", "100KB", "--kv-cache", "fp8")
    assert result.exit_code == 0, result.output
    weight_map = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())["weight_map"]
    calibrated = {n for n in weight_map if n.endswith(("input_scale", "k_scale", "v_scale"))}
    on_disk = set()
    for shard in set(weight_map.values()):
        with safe_open(tmp_path / "dst" / shard, "pt") as f:
            on_disk |= {n for n in f.keys() if weight_map[n] == shard}
    assert calibrated and calibrated <= on_disk and len(set(weight_map.values())) > 1
    assert runner.invoke(app, ["verify", str(tmp_path / "dst")]).exit_code == 0
