import sys
import time
import json
import torch
sys.path.insert(0, ".")
from benchmarks.qwen2_5_omni_pipeline_gpu import build_checkpoint  # noqa: E402
from pathlib import Path
from omnistage import OmniLLM, SamplingParams
ckpt = Path("/tmp/omni7b_random")
print(build_checkpoint(ckpt, False, torch.device("cuda")), flush=True)
t = time.perf_counter()
llm = OmniLLM(model=str(ckpt), device="cuda")  # defaults: KV split between stages
load = time.perf_counter() - t
kv = {n: e.runner.num_blocks * e.config.block_size for n, e in llm.pipeline.engines.items()}
free, total = torch.cuda.mem_get_info()
p = {"thinker": SamplingParams(temperature=0, min_tokens=32, max_tokens=32, ignore_eos=True),
     "talker": SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05,
                              min_tokens=96, max_tokens=96, stop_token_ids=[8292, 8294], suppress_token_ids=[8293])}
ids = list(range(1000, 1060))
for _ in range(2):
    t = time.perf_counter(); o = llm.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0]; dt = time.perf_counter() - t
print(json.dumps({"load_s": round(load, 1), "kv_tokens": kv, "free_GiB_after_load": round(free / 2**30, 1),
                  "e2e_s": round(dt, 2), "codes": len(o.stages["talker"].token_ids), "audio_samples": len(o.audio),
                  "error": o.error, "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1)}))
