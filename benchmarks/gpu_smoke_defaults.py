"""Smoke check of OmniLLM's defaults on one GPU at Qwen2.5-Omni-7B shapes (random weights): the
whole pipeline loads with no engine options (KV split between stages) and speaks. Prints JSON."""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, ".")
from benchmarks.qwen2_5_omni_pipeline_gpu import build_checkpoint  # noqa: E402
from omnistage import OmniLLM, SamplingParams  # noqa: E402


def main() -> None:
    ckpt = Path("/tmp/omni7b_random")
    print(build_checkpoint(ckpt, False, torch.device("cuda")), flush=True)
    t = time.perf_counter()
    llm = OmniLLM(model=str(ckpt), device="cuda")
    load = time.perf_counter() - t
    kv = {n: e.runner.num_blocks * e.config.block_size for n, e in llm.pipeline.engines.items()}
    free, _ = torch.cuda.mem_get_info()
    params = {
        "thinker": SamplingParams(temperature=0, min_tokens=32, max_tokens=32, ignore_eos=True),
        "talker": SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05,
                                 min_tokens=96, max_tokens=96, stop_token_ids=[8292, 8294],
                                 suppress_token_ids=[8293])}
    prompt = {"prompt_token_ids": list(range(1000, 1060))}
    for _ in range(2):  # the first run compiles and captures graphs
        t = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        e2e = time.perf_counter() - t
    print(json.dumps({
        "load_s": round(load, 1), "kv_tokens": kv, "free_GiB_after_load": round(free / 2**30, 1),
        "e2e_s": round(e2e, 2), "codes": len(out.stages["talker"].token_ids),
        "audio_samples": len(out.audio), "error": out.error,
        "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1)}))


if __name__ == "__main__":
    main()
