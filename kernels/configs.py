"""Launch configs of the grouped GEMM: tuned JSON tables, else a heuristic.

A tuned table is a JSON file in the `quantize_moe.configs` package named

    E={E},N={N},device_name={device}[,dtype=fp8_w8a8][,block_shape=[bn,bk]].json

(N is the output width of the first GEMM, 2I) mapping a token count to an
entry; the entry whose token count is nearest to the actual one is used. An
entry is either one launch config for both GEMMs (vLLM's format) or
{"gemm1": config, "gemm2": config} (what scripts/tune_moe.py writes: the two
GEMMs have different shapes and want different tiles). Both GEMMs must share
BLOCK_SIZE_M, because one align step pads the expert runs for both.

A launch config holds CONFIG_KEYS and optionally SPLIT_K (default 1: each
program owns a whole K loop; more splits the K loop over that many programs,
which add into a zeroed float32 output), TMA_B (default false: load weight
tiles through a TMA descriptor; Hopper and later), PERSISTENT (default false:
one program per SM walks the tiles; see fused_moe.py) and, for block-scaled
weights, RESCALE_ACC (default false: how the K loop applies the block scales;
see fused_moe.py).
"""

import functools
import json
from importlib import resources

import torch

from quantize_moe.quantization.spec import MoEQuantSpec

CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
GEMMS = ("gemm1", "gemm2")


def config_file_name(num_experts: int, n: int, device_name: str, quant: MoEQuantSpec) -> str:
    parts = [f"E={num_experts}", f"N={n}", f"device_name={device_name.replace(' ', '_')}"]
    if quant.is_fp8:
        parts.append("dtype=fp8_w8a8")
    if quant.block_shape is not None:
        parts.append(f"block_shape=[{quant.block_shape[0]},{quant.block_shape[1]}]")
    return ",".join(parts) + ".json"


def per_gemm(entry: dict) -> tuple[dict, dict]:
    """(GEMM1 config, GEMM2 config) of a table entry in either format."""
    gemm1, gemm2 = (entry["gemm1"], entry["gemm2"]) if "gemm1" in entry else (entry, entry)
    if gemm1["BLOCK_SIZE_M"] != gemm2["BLOCK_SIZE_M"]:
        raise ValueError(f"the two GEMMs must share BLOCK_SIZE_M: {gemm1} vs {gemm2}")
    return gemm1, gemm2


@functools.cache
def load_tuned_table(file_name: str) -> dict[int, tuple[dict, dict]] | None:
    """The table of one shape, keyed by token count, or None if nobody tuned it."""
    path = resources.files("quantize_moe.configs").joinpath(file_name)
    if not path.is_file():
        return None
    return {int(tokens): per_gemm(entry) for tokens, entry in json.loads(path.read_text()).items()}


def default_config(num_tokens: int, num_experts: int, top_k: int, quant: MoEQuantSpec) -> dict:
    """A heuristic for untuned shapes, sized by the rows one expert sees on average.

    Few rows per expert: the layer streams weights (memory bound), so small
    BLOCK_M keeps padding waste low and many narrow programs keep loads in
    flight. Many rows: larger tiles raise arithmetic intensity.
    """
    rows_per_expert = num_tokens * top_k / num_experts
    block_k = 128 if quant.is_fp8 else 64  # 128 bytes per row either way; divides the 128 quant group
    if rows_per_expert <= 16:
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=block_k, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    if rows_per_expert <= 96:
        return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=block_k, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    return dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=block_k, GROUP_SIZE_M=8, num_warps=8, num_stages=3)


def get_config(num_tokens: int, num_experts: int, n: int, top_k: int, quant: MoEQuantSpec) -> tuple[dict, dict]:
    """(GEMM1, GEMM2) configs: the tuned entry nearest in token count for this device and shape,
    else the heuristic for both."""
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    table = load_tuned_table(config_file_name(num_experts, n, device_name, quant))
    if table:
        return table[min(table, key=lambda tokens: abs(tokens - num_tokens))]
    config = default_config(num_tokens, num_experts, top_k, quant)
    return config, config
