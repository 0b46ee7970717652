"""Write a Mixtral-shaped bf16 checkpoint of random weights, straight to safetensors, for benchmarks.

No model is built: each tensor is generated in turn with the Hub's names and
Mixtral-8x7B's shapes (hidden 4096, expert width 14336, 8 experts, GQA with 8
KV heads), shards of about --shard-gb are written one at a time with the index
and a config.json, so memory stays near one shard. Vocabulary and layer count
are small by default so the experts dominate, as in the real model.

    python scripts/make_synthetic_mixtral.py bench/mixtral-n2 --layers 2    # 6.3 GB; any folder with room
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, EXPERT_WIDTH, EXPERTS, HEADS, KV_HEADS = 4096, 14336, 8, 32, 8


def tensor_shapes(layers: int, vocab: int):
    """(name, shape) of every tensor, in the order a Mixtral checkpoint lists them."""
    head_dim = HIDDEN // HEADS
    yield "model.embed_tokens.weight", (vocab, HIDDEN)
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", (HIDDEN,)
        yield f"{prefix}.post_attention_layernorm.weight", (HIDDEN,)
        for proj, rows in (("q_proj", HIDDEN), ("k_proj", KV_HEADS * head_dim), ("v_proj", KV_HEADS * head_dim),
                           ("o_proj", HIDDEN)):
            yield f"{prefix}.self_attn.{proj}.weight", (rows, HIDDEN)
        yield f"{prefix}.block_sparse_moe.gate.weight", (EXPERTS, HIDDEN)
        for expert in range(EXPERTS):
            experts = f"{prefix}.block_sparse_moe.experts.{expert}"
            yield f"{experts}.w1.weight", (EXPERT_WIDTH, HIDDEN)
            yield f"{experts}.w3.weight", (EXPERT_WIDTH, HIDDEN)
            yield f"{experts}.w2.weight", (HIDDEN, EXPERT_WIDTH)
    yield "model.norm.weight", (HIDDEN,)
    yield "lm_head.weight", (vocab, HIDDEN)


def set_shape(hidden: int, expert_width: int, experts: int) -> None:
    """Shrink (or grow) the Mixtral shapes every function here uses."""
    global HIDDEN, EXPERT_WIDTH, EXPERTS
    HIDDEN, EXPERT_WIDTH, EXPERTS = hidden, expert_width, experts


def config(layers: int, vocab: int) -> dict:
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "torch_dtype": "bfloat16",
        "hidden_size": HIDDEN, "intermediate_size": EXPERT_WIDTH, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_local_experts": EXPERTS,
        "num_experts_per_tok": 2, "vocab_size": vocab, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 1e6, "hidden_act": "silu", "tie_word_embeddings": False,
    }


def random_weight(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator, device=generator.device) * 0.02).to(torch.bfloat16).cpu()


def write_checkpoint(folder: Path, layers: int, vocab: int, shard_bytes: int, seed: int = 0,
                     device: str = "cpu") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device).manual_seed(seed)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(layers, vocab):
        nbytes = 2 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_weight(shape, generator) for name, shape in shard}
        save_file(tensors, folder / file, metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        print(f"wrote {file} ({sum(t.nbytes for t in tensors.values()) / 1e9:.2f} GB)", flush=True)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps(config(layers, vocab), indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-gb", type=float, default=2.0)
    parser.add_argument("--device", default="cpu", help="draw the weights here (cuda: fast enough for N=32)")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="smaller shapes for tests (a multiple of 32)")
    parser.add_argument("--expert-width", type=int, default=EXPERT_WIDTH)
    parser.add_argument("--experts", type=int, default=EXPERTS)
    args = parser.parse_args()
    set_shape(args.hidden, args.expert_width, args.experts)
    write_checkpoint(args.folder, args.layers, args.vocab, int(args.shard_gb * 1e9), device=args.device)


if __name__ == "__main__":
    main()
