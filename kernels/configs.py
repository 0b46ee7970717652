"""Launch configs of the grouped GEMM: tuned JSON tables, else a heuristic.

A tuned table is a JSON file in the `quantize_moe.configs` package named

    E={E},N={N},device_name={device}[,dtype=fp8_w8a8][,block_shape=[bn,bk]].json

(N is the output width of the first GEMM, 2I; the second GEMM uses the same
table) mapping a token count to a config dict; the entry whose token count is
nearest to the actual one is used.
"""

import functools
import json
from importlib import resources

import torch

from quantize_moe.moe.quant_spec import MoEQuantSpec

CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def config_file_name(num_experts: int, n: int, device_name: str, quant: MoEQuantSpec) -> str:
    parts = [f"E={num_experts}", f"N={n}", f"device_name={device_name.replace(' ', '_')}"]
    if quant.is_fp8:
        parts.append("dtype=fp8_w8a8")
    if quant.block_shape is not None:
        parts.append(f"block_shape=[{quant.block_shape[0]},{quant.block_shape[1]}]")
    return ",".join(parts) + ".json"


@functools.cache
def load_tuned_table(file_name: str) -> dict[int, dict] | None:
    """The table of one shape, keyed by token count, or None if nobody tuned it."""
    path = resources.files("quantize_moe.configs").joinpath(file_name)
    if not path.is_file():
        return None
    return {int(tokens): config for tokens, config in json.loads(path.read_text()).items()}


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


def get_config(num_tokens: int, num_experts: int, n: int, top_k: int, quant: MoEQuantSpec) -> dict:
    """The tuned config nearest in token count for this device and shape, else the heuristic."""
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    table = load_tuned_table(config_file_name(num_experts, n, device_name, quant))
    if table:
        return table[min(table, key=lambda tokens: abs(tokens - num_tokens))]
    return default_config(num_tokens, num_experts, top_k, quant)
