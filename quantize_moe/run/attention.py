"""The keys and values a family's attention caches, reached where its attention module hands them to the
attention function: after k_proj/v_proj, any k norm and rotary, which is what vLLM writes into its cache.

transformers looks the function up by `config._attn_implementation`, so registering one that calls
`around(module, key, value)` first and then the original (with the original's masks) lets calibration
record keys and values and `evaluate` round them through an FP8 cache, without touching the modules."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

from quantize_moe.errors import UserError

KeyValue = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@contextmanager
def attention_through(config, name: str, around: KeyValue, advice: str):
    """While active, every attention module of the model built from `config` passes its keys and values
    through `around` (registered as attention implementation `name`); `advice` ends the refusal for a family
    whose attention is not one of transformers' registered functions."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = config._attn_implementation
    if original not in ALL_ATTENTION_FUNCTIONS or original not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise UserError(f"The KV cache is reached through transformers' attention functions, but this family runs "
                        f"'{original}' attention; {advice}.")
    attend = ALL_ATTENTION_FUNCTIONS[original]

    def attention(module, query, key, value, *args, **kwargs):
        key, value = around(module, key, value)
        return attend(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = original
