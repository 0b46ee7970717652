"""Load checkpoints in vLLM (CPU build) one after another in one process and record prompt logprobs.

Run with the vLLM venv's python by tests/test_vllm_client.py:
    python driver.py JOB.json RESULT.json
JOB: {"models": {name: folder}, "prompts": [[token ids]], "max_model_len": int, "no_amx": bool}.
RESULT: per name, either {"error": "..."} or, per prompt position after the first, the logprob
vLLM gave the actual next token and the token it ranks first, plus load+run seconds.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0")


def _score(ids: list[int], prompt_logprobs) -> tuple[list[float], list[int]]:
    logprobs, top1 = [], []
    for token, ranked in zip(ids[1:], prompt_logprobs[1:]):
        logprobs.append(ranked[token].logprob)
        top1.append(next(t for t, lp in ranked.items() if lp.rank == 1))
    return logprobs, top1


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    import torch

    if job.get("no_amx"):  # what vLLM-CPU sees on a CPU without AMX tiles (most CI runners)
        torch.cpu._is_amx_tile_supported = lambda: False
    sys.path.insert(0, str(Path(__file__).parent))
    import standin
    from vllm import LLM, SamplingParams

    standin.install()
    params = SamplingParams(prompt_logprobs=1, detokenize=False, max_tokens=1)
    results = {}
    for name, folder in job["models"].items():
        start = time.perf_counter()
        try:
            llm = LLM(model=folder, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                      max_model_len=job["max_model_len"], model_loader_extra_config={"enable_weights_track": True})
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
        except Exception as error:  # reported per model; the next one still runs
            results[name] = {"error": f"{type(error).__name__}: {error}".strip()}
            continue
        scored = [_score(ids, out.prompt_logprobs) for ids, out in zip(job["prompts"], outputs)]
        results[name] = {"logprobs": [x for lp, _ in scored for x in lp], "top1": [x for _, t in scored for x in t],
                         "seconds": round(time.perf_counter() - start, 2)}
        del llm, outputs
        gc.collect()
    Path(result_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
