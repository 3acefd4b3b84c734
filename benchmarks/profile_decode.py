"""Where a batch-1 thinker decode step goes on the GPU: graph replay time (CUDA events) vs the
whole engine step (host scheduling, input prep, sampling, sync), plus a cProfile of the host
side. 7B thinker shapes, random bf16 weights. Prints JSON."""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.qwen2_5_omni_gpu import build, omni_config, prompt_ids, thinker_seqs  # noqa: E402
from omnistage.engine.ar.engine import AREngine  # noqa: E402
from omnistage.engine.ar.scheduler import EngineConfig  # noqa: E402
from omnistage.models.qwen2_5_omni.thinker import Qwen2_5OmniThinkerForCausalLM  # noqa: E402


def main() -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    cfg = omni_config(False)["thinker_config"]
    model = build(Qwen2_5OmniThinkerForCausalLM, cfg, dev, dtype)
    engine = AREngine(model, EngineConfig(max_model_len=2048, max_num_seqs=8, num_kv_blocks=512),
                      dev, dtype)
    prompt = prompt_ids(cfg["text_config"]["vocab_size"], False)
    seqs = thinker_seqs(prompt, 400, 1, "p")
    for s in seqs:
        engine.add_request(s)
    for _ in range(40):  # prefill, capture, warm up
        engine.step()
    graphs = engine.runner.graphs
    replay_ms = []
    real_run = graphs.run

    def timed_run(*a, **k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = real_run(*a, **k)
        end.record()
        end.synchronize()
        replay_ms.append(start.elapsed_time(end))
        return out
    graphs.run = timed_run
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 100
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    step_ms = 1e3 * (time.perf_counter() - t0) / n
    graphs.run = real_run
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        engine.step()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    print(s.getvalue()[-6000:], file=sys.stderr)
    print(json.dumps({"device": torch.cuda.get_device_name(), "step_ms": round(step_ms, 3),
                      "graph_replay_ms": round(sum(replay_ms) / len(replay_ms), 3)}))


if __name__ == "__main__":
    main()
