"""Search launch configs of the two grouped GEMMs and write tuned tables (configs/ format).

For every shape, mode and token count it times each GEMM alone (CUDA graph,
median, a short window) over a search space pruned by how many rows one expert
sees; pairs the fastest few GEMM1 and GEMM2 configs of each BLOCK_SIZE_M (which
both share: one align step feeds both); times those pairs back to back in the
benchmark's window, the quantity scripts/benchmark_moe.py reports, and keeps
the fastest; the table's current entry for that token count runs among
the finalists too. (On compute-bound rows, GEMMs timed alone in short windows read
up to 21% faster than the same configs back to back in 20 ms windows, and did not
rank them the same.) It writes, per (shape, mode), a table {tokens: {"gemm1":
..., "gemm2": ...}} named as kernels/configs.py expects; where that table
exists, only the rows of the token counts tuned are replaced.

Compiling dominates a search, so it is done first-come in parallel processes
(`--jobs`), in the order the timing process needs the kernels, and timing
waits only for the configs it is about to time. A kernel's compiled form does
not depend on the token count or, for these shapes, on the model (sizes and
strides are all multiples of 16), so each (mode, GEMM, config) compiles once.

    python scripts/tune_moe.py --out-dir configs --json tune.json --jobs 16
"""

import argparse
import itertools
import json
import multiprocessing
import time
from pathlib import Path

import torch

from moe_problems import MODES, REP_MS, SHAPES, TOKENS, GemmInputs, Shape, parse_shape, random_weights, time_us
from quantize_moe.kernels.configs import config_file_name, per_gemm
from quantize_moe.kernels.fused_moe import gemm_output, invoke_grouped_gemm
from quantize_moe.quantization.spec import MoEQuantSpec

SHARED_MEMORY = 227 * 1024  # bytes per block on an H100/H200
MEMORY_BOUND_ROWS = 16  # average rows per expert up to which the GEMMs stream weights
QUICK_REP_MS, FINALISTS = 0.5, 2


def rows_per_expert(shape: Shape, tokens: int) -> float:
    return tokens * shape.top_k / shape.experts


def search_space(shape: Shape, tokens: int, quant: MoEQuantSpec) -> list[dict]:
    """Launch configs worth timing at this token count.

    Few rows per expert (memory bound): BLOCK_M 16 or 32, narrow N tiles, deep
    pipelines and split-K, so that many programs stream weights at once.
    Many rows (compute bound): BLOCK_M 64-128, wide tiles, grouped ordering
    and 8 warps for the big tiles, one program per tile or a persistent grid.
    Weight tiles by pointers or TMA; BLOCK_K dividing the 128 quantization
    group in block mode, and both ways of applying block scales when compute
    bound; the pipeline stages within the SM's shared memory. Pruned after a wider
    first search on the H200 (Mixtral FP8 at T=1 and T=4096: docs/performance.md).
    """
    rows = rows_per_expert(shape, tokens)
    memory_bound = rows <= MEMORY_BOUND_ROWS
    element_bytes = 1 if quant.is_fp8 else 2
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows) and m >= min(64, rows / 4)]
    if memory_bound:
        block_ns, stages = (32, 64, 128), (3, 5)
        block_ks = (128, 256) if quant.weight == "tensor" else (64, 128)
        split_ks = (1, 2, 4) if rows <= 4 else (1,)
    else:
        block_ns, stages = ((64, 128, 256) if rows < 256 else (128, 256)), (3, 4)
        block_ks = (128,) if quant.is_fp8 else (64, 128)
        split_ks = (1,)
    group_ms = (8,) if rows >= 64 else (1,)
    # Where the tensor cores are busy: both ways of applying block scales, and a persistent grid
    # (fused_moe.py).
    rescales = (False, True) if quant.weight == "block" and not memory_bound else (None,)
    persistents = (False,) if memory_bound else (False, True)
    space = []
    for m, n, k, g, s, split, tma, persistent in itertools.product(block_ms, block_ns, block_ks, group_ms, stages,
                                                                   split_ks, (False, True), persistents):
        if s * (m + n) * k * element_bytes > SHARED_MEMORY or (split > 1 and m > 16):
            continue
        for warps in (4, 8) if m * n >= 128 * 128 else (4,):
            config = dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n, BLOCK_SIZE_K=k, GROUP_SIZE_M=g,
                          num_warps=warps, num_stages=s, SPLIT_K=split, TMA_B=tma, PERSISTENT=persistent)
            space += [config if rescale is None else dict(config, RESCALE_ACC=rescale) for rescale in rescales]
    return space


def compile_gemm(job: tuple[Shape, str, int, dict]) -> str | None:
    """Compile one kernel into Triton's cache on meta tensors (no GPU memory); the error, if any."""
    shape, mode, index, config = job
    quant = MODES[mode]
    e, h, i, k = shape.experts, shape.hidden, shape.inter, shape.top_k
    n_out, n_in = ((2 * i, h), (h, i))[index]
    pairs, rows = 64 * k, (64, 64 * k)[index]
    dtype = torch.float8_e4m3fn if quant.is_fp8 else torch.bfloat16
    meta = dict(device="meta")
    a_scale_shape = {"none": None, "tensor": (1,), "block": (rows, n_in // 128)}[quant.weight]
    b_scale_shape = {"none": None, "tensor": (e,), "block": (e, n_out // 128, n_in // 128)}[quant.weight]
    try:
        invoke_grouped_gemm(
            torch.empty(rows, n_in, dtype=dtype, **meta),
            a_scale_shape and torch.empty(a_scale_shape, **meta),
            torch.empty(e, n_out, n_in, dtype=dtype, **meta),
            b_scale_shape and torch.empty(b_scale_shape, **meta),
            gemm_output(pairs, n_out, torch.bfloat16, config, "meta"),
            torch.empty(pairs, **meta) if index else None,
            torch.empty(pairs, dtype=torch.int32, **meta), torch.empty(pairs, dtype=torch.int32, **meta),
            torch.empty(1, dtype=torch.int32, **meta), (k, 1)[index], quant, config, warmup=True,
        )
    except Exception as error:  # noqa: BLE001 - reported, then the timing process compiles it itself
        return f"{mode} gemm{index + 1} {config}: {error}"
    return None


def compile_key(mode: str, index: int, config: dict) -> str:
    return json.dumps([mode, index, config], sort_keys=True)


class Compiler:
    """Compiles every (mode, GEMM, config) once, in parallel, in the order it is first asked for."""

    def __init__(self, jobs: int, order: list[tuple[Shape, str, int, dict]]):
        self.pool = multiprocessing.get_context("spawn").Pool(jobs, initializer=torch.cuda.init)
        self.pending = {}
        for job in order:
            key = compile_key(*job[1:])
            if key not in self.pending:
                self.pending[key] = self.pool.apply_async(compile_gemm, (job,))

    def wait(self, mode: str, index: int, config: dict) -> None:
        error = self.pending[compile_key(mode, index, config)].get()
        if error:
            print("compile failed:", error, flush=True)

    def close(self):
        self.pool.terminate()


def finalist_pairs(timed1: list[tuple[float, dict]], timed2: list[tuple[float, dict]],
                   incumbent: tuple[dict, dict] | None = None) -> list[tuple[dict, dict]]:
    """(GEMM1, GEMM2) pairs of the FINALISTS fastest configs of each GEMM for every BLOCK_SIZE_M, and
    the table's current pair (`incumbent`) if it is not among them."""
    def best(timed):
        by_m = {}
        for _, config in sorted(timed, key=lambda t: t[0]):
            by_m.setdefault(config["BLOCK_SIZE_M"], []).append(config)
        return {m: configs[:FINALISTS] for m, configs in by_m.items()}

    best1, best2 = best(timed1), best(timed2)
    pairs = [(c1, c2) for m in sorted(best1.keys() & best2.keys()) for c1 in best1[m] for c2 in best2[m]]
    return pairs + [incumbent] if incumbent and incumbent not in pairs else pairs


def tune_row(inputs: GemmInputs, mode: str, compiler: Compiler, incumbent: tuple[dict, dict] | None) -> dict:
    """The fastest (GEMM1, GEMM2) pair for one token count, with its time and the runners-up. The
    table's current entry for this token count (`incumbent`) runs among the finalists, so re-tuning
    never replaces it with a pair that times slower back to back."""
    space = search_space(inputs.shape, inputs.tokens, inputs.quant)
    timed = []
    for index in (0, 1):
        alone = []
        for config in space:
            compiler.wait(mode, index, config)
            alone.append((time_us(inputs.gemm(index, config), QUICK_REP_MS), config))
        timed.append(alone)
    pairs = finalist_pairs(*timed, incumbent)
    finals = sorted(((time_us(inputs.both(c1, c2), REP_MS), c1, c2) for c1, c2 in pairs), key=lambda final: final[0])
    gemms_us, config1, config2 = finals[0]
    return dict(tokens=inputs.tokens, gemms_us=gemms_us, gemm1=config1, gemm2=config2, candidates=len(space),
                kept=(config1, config2) == incumbent, runners_up=finals[1:])


def read_table(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def merged_table(path: Path, tuned: dict) -> dict:
    """The table at `path` (if any) with the rows just tuned replaced: re-tuning some token counts
    keeps the others."""
    table = {**read_table(path), **tuned}
    return dict(sorted(table.items(), key=lambda row: int(row[0])))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=list(SHAPES.values()),
                        help=f"{', '.join(SHAPES)} or any model's EXPERTS,HIDDEN,INTERMEDIATE,TOP_K")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--out-dir", required=True, help="write one tuned table per shape and mode here")
    parser.add_argument("--json", help="write every tuned row (times and configs) to this file")
    parser.add_argument("--jobs", type=int, default=multiprocessing.cpu_count(), help="compile processes")
    args = parser.parse_args()

    work = [(s, m) for s in args.shapes for m in args.modes]
    order = [(s, m, index, config) for s, m in work for tokens in args.tokens for index in (0, 1)
             for config in search_space(s, tokens, MODES[m])]
    started = time.perf_counter()
    compiler = Compiler(args.jobs, order)
    torch.manual_seed(0)
    results = []
    for shape, mode in work:
        quant = MODES[mode]
        weights = random_weights(shape, quant)
        path = Path(args.out_dir) / config_file_name(shape.experts, 2 * shape.inter, torch.cuda.get_device_name(), quant)
        current = {int(tokens): per_gemm(entry) for tokens, entry in read_table(path).items()}
        table = {}
        for tokens in args.tokens:
            row = tune_row(GemmInputs(shape, quant, weights, tokens), mode, compiler, current.get(tokens))
            table[str(tokens)] = dict(gemm1=row["gemm1"], gemm2=row["gemm2"])
            results.append(dict(shape=shape.name, mode=mode, **row))
            print(f"{time.perf_counter() - started:6.0f}s {shape.name:14} {mode:13} T={tokens:<5} "
                  f"both GEMMs {row['gemms_us']:8.1f} µs  "
                  f"({row['candidates']} candidates{', kept the entry' if row['kept'] else ''})  "
                  f"{row['gemm1']}  {row['gemm2']}", flush=True)
        path.write_text(json.dumps(merged_table(path, table), indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        del weights
        torch.cuda.empty_cache()
    compiler.close()


if __name__ == "__main__":
    main()
