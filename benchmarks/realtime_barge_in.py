"""Barge-in latency of /v1/realtime: a user speaks over an answer that is still being spoken.

An in-process server (uvicorn on a thread) serves a model (default: the tiny random Qwen2.5-Omni,
built in a temp dir) with long answers; a `websockets` client opens a session with server VAD
(create_response off), asks a spoken question (conversation.item.create), and once the answer's
first audio delta arrives it streams an espeak-ng clip in 20 ms chunks at real-time pace, as a
microphone would. Per trial, from the moment the chunk holding the speech onset was sent:
  vad_ms        -> input_audio_buffer.speech_started received
  last_delta_ms -> the last response.output_audio.delta received (audio stops)
  cancel_ms     -> response.done (status cancelled) received
  idle_ms       -> every AR stage has no running/waiting request and holds no KV block
Usage: python benchmarks/realtime_barge_in.py [--model DIR] [--trials 10] [--device cpu]
         [--out FILE]   (prints one JSON object)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import datetime
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402

RATE = 24000
CHUNK = RATE // 50  # 20 ms


def _clip(text: str) -> tuple[np.ndarray, int]:
    """espeak-ng speech at 24 kHz int16 and the sample of its onset."""
    from omnistage.models.qwen2_5_omni.media import resample
    wav = subprocess.run(["espeak-ng", "--stdout", text], capture_output=True,
                         check=True).stdout
    x, sr = soundfile.read(io.BytesIO(wav), dtype="float32")
    x = resample(x, sr, RATE)
    onset = int(np.argmax(np.abs(x) > 0.02 * np.abs(x).max()))
    return np.round(x * 32767).astype(np.int16), onset


def _b64(pcm: np.ndarray) -> str:
    return base64.b64encode(pcm.astype("<i2").tobytes()).decode()


def _idle(llm) -> bool:
    for engine in llm.pipeline.engines.values():
        s = engine.stats
        if s["num_running"] or s["num_waiting"] or s["num_free_blocks"] != s["num_kv_blocks"]:
            return False
    return not llm.runtime.num_active()


async def _trial(url: str, llm, question: np.ndarray, speech: np.ndarray, onset: int) -> dict:
    import websockets
    async with websockets.connect(url, max_size=None) as ws:
        async def recv() -> dict:
            return json.loads(await asyncio.wait_for(ws.recv(), 120))

        assert (await recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500,
                               "create_response": False}}}}}))
        while (await recv())["type"] != "session.updated":
            pass
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_audio", "audio": _b64(question)}]}}))
        await ws.send(json.dumps({"type": "response.create"}))
        while (await recv())["type"] != "response.output_audio.delta":
            pass
        marks: dict[str, float] = {}

        async def speak() -> None:  # a microphone: 20 ms chunks in real time
            t0 = time.perf_counter()
            for i in range(0, len(speech), CHUNK):
                if i <= onset < i + CHUNK:
                    marks["onset"] = time.perf_counter()
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": _b64(speech[i:i + CHUNK])}))
                await asyncio.sleep(max(0.0, t0 + (i + CHUNK) / RATE - time.perf_counter()))

        mic = asyncio.get_running_loop().create_task(speak())
        status, late = None, 0
        while True:
            ev = await recv()
            now = time.perf_counter()
            if ev["type"] == "input_audio_buffer.speech_started":
                marks["vad"] = now
            elif ev["type"] == "response.output_audio.delta":
                marks["last_delta"] = now
                late += "onset" in marks
            elif ev["type"] == "response.done":
                marks["done"], status = now, ev["response"]["status"]
                break
        while not _idle(llm):
            await asyncio.sleep(0.001)
        marks["idle"] = time.perf_counter()
        mic.cancel()
    if status != "cancelled" or "onset" not in marks:
        return {"status": status, "error": "the answer ended before the user spoke"}
    t0 = marks["onset"]
    return {"status": status, "vad_ms": round(1e3 * (marks["vad"] - t0), 1),
            # (<= 0: no audio delta came after the onset)
            "last_delta_ms": round(1e3 * (marks.get("last_delta", t0) - t0), 1),
            "audio_deltas_after_onset": late,
            "cancel_ms": round(1e3 * (marks["done"] - t0), 1),
            "speech_started_to_done_ms": round(1e3 * (marks["done"] - marks["vad"]), 1),
            "idle_ms": round(1e3 * (marks["idle"] - t0), 1)}


def _stats(values: list[float]) -> dict:
    v = sorted(values)
    return {"p50": v[len(v) // 2], "p90": v[min(len(v) - 1, int(0.9 * len(v)))],
            "min": v[0], "max": v[-1]} if v else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: tiny Qwen2.5-Omni)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()
    import torch

    from omnistage.entrypoints.async_llm import AsyncOmniLLM
    from omnistage.entrypoints.openai.server import build_app
    from omnistage.entrypoints.openai.serving import ServerConfig
    from tests.entrypoints.server_utils import ThreadServer

    model = args.model
    if model is None:
        from omnistage.testing.tiny_omni import build_tiny_omni
        model = str(build_tiny_omni(Path(tempfile.mkdtemp()) / "tiny_omni", seed=0))
    llm = AsyncOmniLLM(model, device=args.device, max_model_len=4096)
    thinker, talker = llm.stage_names[:2]
    d = llm.pipeline.default_params  # answers long enough to be interrupted mid-speech
    d[thinker] = dataclasses.replace(d[thinker], min_tokens=300, max_tokens=300)
    d[talker] = dataclasses.replace(d[talker], min_tokens=1500, max_tokens=2000)
    question, _ = _clip("What is the weather like today?")
    speech, onset = _clip("Wait, stop, I have another question.")
    trials = []
    try:
        app = build_app(llm, ServerConfig(served_model_names=["m"], max_audio_seconds=60))
        with ThreadServer(app) as srv:
            url = srv.url.replace("http://", "ws://") + "/v1/realtime?model=m"
            asyncio.run(_trial(url, llm, question, speech, onset))  # warm-up (VAD load)
            for _ in range(args.trials):
                trials.append(asyncio.run(_trial(url, llm, question, speech, onset)))
    finally:
        llm.shutdown()
    ok = [t for t in trials if t["status"] == "cancelled" and "error" not in t]
    result = {
        "benchmark": "realtime_barge_in",
        "date": datetime.date.today().isoformat(),
        "config": {"model": args.model or "tiny Qwen2.5-Omni (omnistage.testing, seed 0)",
                   "device": args.device, "trials": args.trials, "chunk_ms": 20,
                   "vad": "silero (silence_duration_ms 500, threshold 0.5)",
                   "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "platform": platform.platform()},
        "summary_ms": {k: _stats([t[k] for t in ok]) for k in
                       ("vad_ms", "last_delta_ms", "cancel_ms", "speech_started_to_done_ms",
                        "idle_ms")},
        "cancelled_trials": len(ok),
        "trials": trials,
        "note": "times from sending the 20 ms chunk that holds the speech onset; vad_ms "
                "includes the VAD's 32 ms windows and its threshold crossing",
    }
    write_result(result, args.out, load_before)


if __name__ == "__main__":
    main()
