"""Prefill work per turn of a spoken conversation, prefix cache on vs off (hidden-row export).

The tiny random Qwen2.5-Omni (built in a temp dir) answers four espeak-ng questions in one
conversation (each turn re-sends the history, as /v1/realtime does); per turn, the prompt
positions the thinker and the talker computed (prompt minus prefix-cache hits).
Usage: python benchmarks/realtime_prefix_turns.py [--out FILE]   (prints one JSON object)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402

QUESTIONS = ["What is the weather like today?", "And tomorrow?", "Should I take an umbrella?",
             "Thank you, goodbye."]


def _speak(text: str) -> np.ndarray:
    from omnistage.models.qwen2_5_omni.media import resample
    wav = subprocess.run(["espeak-ng", "--stdout", text], capture_output=True,
                         check=True).stdout
    x, sr = soundfile.read(io.BytesIO(wav), dtype="float32")
    return resample(x, sr, 16000).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()
    from omnistage import OmniLLM, SamplingParams
    from omnistage.testing.tiny_omni import build_tiny_omni

    model = str(build_tiny_omni(Path(tempfile.mkdtemp()) / "tiny_omni", seed=0))
    audio = [_speak(q) for q in QUESTIONS]
    result = {"benchmark": "realtime_prefix_turns", "date": datetime.date.today().isoformat(),
              "config": {"model": "tiny Qwen2.5-Omni (omnistage.testing, seed 0)",
                         "device": "cpu", "thinker_max_tokens": 8, "talker_max_tokens": 24}}
    texts = {}
    for cache in (True, False):
        llm = OmniLLM(model, device="cpu", max_model_len=2048, enable_prefix_caching=cache)
        thinker, talker = llm.stage_names[:2]
        params = {thinker: SamplingParams(temperature=0.0, max_tokens=8, seed=11),
                  talker: dataclasses.replace(llm.pipeline.default_params[talker],
                                              max_tokens=24)}
        messages, turns = [], []
        try:
            for clip in audio:
                messages.append({"role": "user", "content": [{"type": "audio", "audio": clip}]})
                stats = {s: llm.pipeline.engines[s].stats for s in (thinker, talker)}
                before = {s: v["prefix_cache_hit_tokens"] for s, v in stats.items()}
                out = llm.generate([{"messages": messages}], params, use_tqdm=False)[0]
                hits = {s: llm.pipeline.engines[s].stats["prefix_cache_hit_tokens"] - before[s]
                        for s in (thinker, talker)}
                n = len(out.prompt_token_ids)
                turns.append({"prompt_tokens": n,
                              "thinker_prefill_computed": n - hits[thinker],
                              "talker_prompt": n + 2,
                              "talker_prefill_computed": n + 2 - hits[talker],
                              "talker_codes": len(out.stages[talker].token_ids)})
                messages.append({"role": "assistant", "content": out.text})
                texts.setdefault(cache, []).append((out.token_ids, out.stages[talker].token_ids))
        finally:
            llm.shutdown()
        result["cache_on" if cache else "cache_off"] = turns
    result["same_tokens_and_codes"] = texts[True] == texts[False]
    write_result(result, args.out, load_before)


if __name__ == "__main__":
    main()
