"""Fuzz the checkpoint reader: whatever the headers, index and config say, opening and
planning either succeeds or raises the one clear `UserError` naming the file (or field) at fault,
never anything else. The config fuzz runs over a real tiny Mixtral shard, so examples that keep
the config consistent reach a plan; the test counts them."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.source.locations import CONFIG_NAME, INDEX_NAME, SINGLE_NAME
from quantize_moe.errors import UserError
from quantize_moe.plan.plan import make_plan
from quantize_moe.source.tiny import TINY_CONFIGS, build_tiny_checkpoint

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHARDS = ("a.safetensors", "b.safetensors")
VALID = save({"x.weight": torch.ones(4, 4, dtype=torch.bfloat16), "y.bias": torch.zeros(3)})

json_values = st.recursive(st.none() | st.booleans() | st.integers(-10, 10**20) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3),
                           max_leaves=8)
dtypes = st.sampled_from(["BF16", "F16", "F32", "F64", "F8_E4M3", "I8", "U8", "BOOL", "C64", "X", ""]) | json_values
entries = st.fixed_dictionaries({"dtype": dtypes, "shape": st.lists(st.integers(-2, 9), max_size=3) | json_values,
                                 "data_offsets": st.lists(st.integers(-4, 300), max_size=3) | json_values})
headers = st.dictionaries(st.text(max_size=10), entries | json_values, max_size=4)
file_names = st.sampled_from([*SHARDS, "missing.safetensors", "../a.safetensors", "/etc/passwd", "", ".",
                              "sub/../a.safetensors", "a\x00.safetensors", "config.json"]) | st.text(max_size=12)


def opens_or_refuses(folder: Path, *names: str) -> None:
    """Opening succeeds, or the UserError names one of `names` (the file at fault)."""
    try:
        Checkpoint(folder)
    except UserError as e:
        assert any(name in str(e) for name in names), str(e)


@st.composite
def shard_bytes(draw) -> bytes:
    """A safetensors-like file: a header of drawn JSON (or bytes) behind a right or wrong length."""
    header = draw(st.binary(max_size=40) | headers.map(lambda h: json.dumps(h).encode()))
    length = draw(st.just(len(header)) | st.integers(0, 2**64 - 1))
    return struct.pack("<Q", length) + header + draw(st.binary(max_size=300))


@FUZZ
@given(data=shard_bytes())
def test_malformed_shard_headers(data):
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / SINGLE_NAME).write_bytes(data)
        opens_or_refuses(Path(tmp), SINGLE_NAME)


@FUZZ
@given(cut=st.integers(0, len(VALID)), flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)),
                                                     max_size=4))
def test_damaged_valid_shard(cut, flips):
    data = bytearray(VALID)
    for position, mask in flips:
        data[position] ^= mask
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / SINGLE_NAME).write_bytes(bytes(data[:cut] if cut % 2 else data))
        opens_or_refuses(Path(tmp), SINGLE_NAME)


@FUZZ
@given(index=st.fixed_dictionaries({"weight_map": st.dictionaries(st.sampled_from(["x.weight", "y.bias", "z"]),
                                                                  file_names | json_values, max_size=3)})
       | json_values)
def test_malformed_indexes(index):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for shard in SHARDS:
            (folder / shard).write_bytes(VALID)
        (folder / INDEX_NAME).write_text(json.dumps(index))
        opens_or_refuses(folder, INDEX_NAME, "The index", *SHARDS)


# Values the tiny Mixtral really has come first, drawn twice as often as arbitrary JSON, so many
# examples keep the config consistent and reach a plan.
PLAUSIBLE = {"model_type": ["mixtral"], "num_local_experts": [4, 8], "num_hidden_layers": [2, 1],
             "hidden_size": [64, 32], "intermediate_size": [96, 48], "num_experts_per_tok": [2, 1, 4],
             "auto_map": [{}]}


def plausible(key: str):
    return st.sampled_from(PLAUSIBLE.get(key, [None]))


@pytest.fixture(scope="module")
def mixtral_shard(tmp_path_factory) -> Path:
    """The tiny Mixtral's single shard, with expert tensors, hard-linked into each example's folder."""
    return build_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("fuzz-src"), max_shard_size="1GB") / SINGLE_NAME


def test_malformed_configs(mixtral_shard):
    outcomes = {"planned": 0, "refused": 0}

    @FUZZ
    @given(changes=st.dictionaries(st.sampled_from([*PLAUSIBLE, "quantization_config"]), st.just(None), min_size=1,
                                   max_size=3).flatmap(lambda keys: st.fixed_dictionaries(
                                       {k: plausible(k) | plausible(k) | json_values for k in keys})))
    def plan_or_refuse(changes):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            os.link(mixtral_shard, folder / SINGLE_NAME)
            (folder / CONFIG_NAME).write_text(json.dumps({"model_type": "mixtral", **TINY_CONFIGS["mixtral"],
                                                          **changes}))
            try:
                make_plan(Checkpoint(folder))
                outcomes["planned"] += 1
            except UserError as e:
                assert CONFIG_NAME in str(e) or any(key in str(e) for key in changes), str(e)
                outcomes["refused"] += 1

    plan_or_refuse()
    total = sum(outcomes.values())
    assert outcomes["planned"] >= 0.2 * total and outcomes["refused"] >= 0.2 * total, outcomes
