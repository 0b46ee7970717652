"""Real clients read our output: transformers (with accelerate) on CPU and the compressed-tensors library.

transformers' GPU FP8 path fetches kernels from the Hub at run time, so CI checks its CPU path, which
dequantizes FP8 weights at load; the GPU check of the quantized model is `validate`.
"""

from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import match_name
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config
from transformers.utils import logging as transformers_logging

from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.write.dequantize import dequantize_checkpoint
from quantize_moe.plan.compatibility import LOADS, loading_engines
from quantize_moe.quantization.fp8 import FP8_DTYPE
from quantize_moe.plan.options import Options
from quantize_moe.write.job import quantize_checkpoint

FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3")
FOR_TRANSFORMERS = [c for c in LOADS if "transformers" in loading_engines(*c)]
NOT_FOR_TRANSFORMERS = [c for c in LOADS if c not in FOR_TRANSFORMERS]
LLAMA4_FOR_TRANSFORMERS = [c for c in LOADS if "transformers" in loading_engines(*c, "Llama-4")]
DEQUANTIZE_AT_LOAD = {"fp8": FineGrainedFP8Config(dequantize=True),
                      "compressed-tensors": CompressedTensorsConfig(dequantize=True)}


@pytest.fixture(autouse=True)
def quiet_transformers():
    transformers_logging.set_verbosity_error()


def _quantize(src: Path, out: Path, fmt: str, scheme: str) -> Path:
    quantize_checkpoint(src, out, Options(format=fmt, scheme=scheme), show_progress=False)
    return out


def _load(folder: Path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kwargs).eval()


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    return model(ids).logits.float()


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")  # we pass only `dequantize`
@pytest.mark.parametrize("fmt,scheme", FOR_TRANSFORMERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_our_output_as_we_dequantize_it(family, fmt, scheme, block_friendly, tmp_path):
    src = block_friendly(family)
    out = _quantize(src, tmp_path / "fp8", fmt, scheme)
    dequantize_checkpoint(out, tmp_path / "ours")
    ours = _load(tmp_path / "ours").state_dict()
    theirs = _load(out, quantization_config=DEQUANTIZE_AT_LOAD[fmt]).state_dict()
    assert theirs.keys() == ours.keys()
    for name, value in ours.items():
        assert torch.equal(theirs[name], value), name

    # The default load (for compressed-tensors it also fake-quantizes activations) stays within FP8
    # error of bf16: 4-14% per token on these random 2-3 layer models, where ignored scales give 100% or
    # more (the exact comparison above catches misplaced ones). Per-token median, since a random router
    # flips the top-k of a few near-tied tokens.
    bf16, fp8 = _logits(_load(src)), _logits(_load(out))
    per_token = (fp8 - bf16).norm(dim=-1) / bf16.norm(dim=-1)
    assert per_token.median() < 0.2


@pytest.mark.parametrize("fmt,scheme", NOT_FOR_TRANSFORMERS)
def test_transformers_fails_loudly_where_the_engine_table_says_no(fmt, scheme, block_friendly, tmp_path):
    out = _quantize(block_friendly("mixtral"), tmp_path / "fp8", fmt, scheme)
    with pytest.raises(RuntimeError):
        _logits(_load(out))


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("fmt,scheme", LLAMA4_FOR_TRANSFORMERS)
def test_transformers_loads_llama4_experts_written_per_expert(fmt, scheme, block_friendly, tmp_path):
    """Our Llama-4 output holds one Linear per expert (what vLLM reads). transformers' compressed-tensors
    path builds Llama-4 with per-expert Linears too and dequantizes them to exactly our values."""
    src = block_friendly("llama4_text")
    out = _quantize(src, tmp_path / "fp8", fmt, scheme)
    dequantize_checkpoint(out, tmp_path / "ours")
    ours = Checkpoint(tmp_path / "ours")
    theirs = _load(out, quantization_config=DEQUANTIZE_AT_LOAD[fmt]).state_dict()
    assert theirs.keys() == ours.tensors.keys()
    assert "model.layers.1.feed_forward.experts.3.down_proj.weight" in theirs
    for name, value in theirs.items():
        assert torch.equal(value, ours.get(name)), name
    bf16, fp8 = _logits(_load(src)), _logits(_load(out))  # as above: within FP8 error of bf16
    assert ((fp8 - bf16).norm(dim=-1) / bf16.norm(dim=-1)).median() < 0.2


@pytest.mark.parametrize("fmt,scheme", sorted(set(FOR_TRANSFORMERS) - set(LLAMA4_FOR_TRANSFORMERS)))
def test_transformers_leaves_llama4_experts_out_where_the_table_says_no(fmt, scheme, block_friendly, tmp_path):
    """Elsewhere transformers' Llama-4 keeps fused expert parameters, with no conversion from per-expert
    Linears: they are left missing (randomly initialised), which FAMILY_LOADS says."""
    out = _quantize(block_friendly("llama4_text"), tmp_path / "fp8", fmt, scheme)
    _, info = AutoModelForCausalLM.from_pretrained(out, quantization_config=DEQUANTIZE_AT_LOAD[fmt],
                                                   output_loading_info=True)
    assert {"model.layers.1.feed_forward.experts.gate_up_proj",
            "model.layers.1.feed_forward.experts.down_proj"} <= set(info["missing_keys"])


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_compressed_tensors_decompresses_to_our_values(scheme, block_friendly, tmp_path):
    out = _quantize(block_friendly("deepseek_v3"), tmp_path / "ct", "compressed-tensors", scheme)
    dequantize_checkpoint(out, tmp_path / "ours")
    fp8, ours = Checkpoint(out), Checkpoint(tmp_path / "ours")
    config = QuantizationConfig.model_validate(fp8.raw_config["quantization_config"])
    group = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(config.format)
    linear_weights = [n for n, info in fp8.tensors.items() if n.endswith(".weight") and len(info.shape) == 2
                      and "embed" not in n]
    for name in linear_weights:
        module = name.removesuffix(".weight")
        quantized = fp8.tensors[name].dtype == FP8_DTYPE
        assert quantized != any(match_name(module, entry) for entry in config.ignore), module
        if quantized:
            state = {"weight": fp8.get(name), "weight_scale": fp8.get(f"{module}.weight_scale")}
            assert torch.equal(compressor.decompress(state, group)["weight"].to(torch.bfloat16), ours.get(name)), name
