"""/v1/realtime at 7B shapes on the GPU: the latency from the end of the user's speech to the
answer's first audio, and the barge-in cancel latency, with N concurrent voice sessions.

The server is the real one (build_app + uvicorn) in a subprocess on loopback, serving the random
Qwen2.5-Omni checkpoint at 7B shapes that benchmarks/qwen2_5_omni_pipeline_gpu.py builds (built
once into --ckpt, then reused); `--small` uses that script's tiny config on the CPU (the smoke
test). Its answers are long (--text-tokens thinker tokens, --codes talker codes, eos ignored),
so that every answer is still speaking when the user talks over it.

Each of N sessions (server VAD, create_response and interrupt_response on) has a microphone
task that streams 20 ms pcm16 chunks at real-time pace: silence, or the speech clip
(omnistage/assets/question.wav resampled to 24 kHz; no espeak on the GPU machine) when the
session's script queues it. The script: speak; once the answer's first audio delta arrives,
speak again over it (barge-in), which both cancels that answer and, when the speech ends, is
the next turn; --turns turns; the last answer is ended with response.cancel. Per turn:
  commit_to_audio_ms   input_audio_buffer.committed -> the first response.output_audio.delta
  stopped_to_audio_ms  input_audio_buffer.speech_stopped -> the same delta
and per barge-in (every turn but the first):
  onset_to_cancelled_ms    the chunk holding the speech onset sent -> response.done, cancelled
  started_to_cancelled_ms  input_audio_buffer.speech_started -> that response.done
  onset_to_idle_ms         (N = 1 only) the onset -> every stage idle on /metrics (no request
                           running or queued, every KV block free)
The VAD waits silence_duration_ms (--silence-ms) of silence before it commits: the time from
the last spoken sample to the commit is that plus the VAD's 32 ms windows, and is not included.
Per level, the server's event-loop lag (a 5 ms timer's lateness, `loop_lag_ms`: how long the
loop was busy with something else) comes from a route the benchmark adds; `--profile-server
PATH` also writes a cProfile of the server's event-loop thread there (pstats format).

  GPU:  python benchmarks/realtime_gpu.py --ckpt /tmp/omni7b \\
            --out benchmarks/results/realtime_gpu_h100.json
  (a first run on a fresh machine may build the checkpoint alone first: add --build-only)
  CPU:  python benchmarks/realtime_gpu.py --small --ckpt /tmp/omni_small --concurrency 1,4 \\
            --turns 3 --out benchmarks/results/realtime_gpu_small_cpu_2026-11-28.json
Besides torch, numpy and transformers, the client imports `websockets`; the server needs
fastapi, starlette, pydantic, uvicorn, websockets, prometheus-client, python-multipart, httpx
and silero-vad (soundfile is replaced by a stub when missing: nothing here decodes files)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import importlib.machinery
import json
import os
import platform
import subprocess
import sys
import time
import types
import urllib.request
import wave
from pathlib import Path

import numpy as np

try:
    import soundfile  # noqa: F401
except ImportError:  # the GPU machine lacks it; nothing here reads audio files with it
    sys.modules["soundfile"] = types.ModuleType("soundfile")
    sys.modules["soundfile"].__spec__ = importlib.machinery.ModuleSpec("soundfile", None)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import free_port, stop_server, write_result  # noqa: E402

RATE = 24000
CHUNK = RATE // 50  # 20 ms, as a microphone's worklet sends
MODEL = "omni"
CLIP = ROOT / "omnistage" / "assets" / "question.wav"


# ------------------------------------------------------------------ the server (subprocess)
MEDIA_TOKENS = {"audio_token_index": "<|AUDIO|>", "image_token_index": "<|IMAGE|>",
                "video_token_index": "<|VIDEO|>", "audio_start_token_id": "<|audio_bos|>",
                "audio_end_token_id": "<|audio_eos|>", "vision_start_token_id": "<|vision_bos|>",
                "vision_end_token_id": "<|vision_eos|>"}


def align_media_ids(ckpt: Path) -> dict[str, int]:
    """The random checkpoint keeps the real model's special ids (151646...) but ships the tiny
    test tokenizer, whose media placeholders have other ids: text-id prompts (the pipeline
    benchmark's) never meet them, a spoken turn does. Set the thinker's and talker's media ids
    to the tokenizer's (idempotent; the weights do not depend on them: they are random)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = {key: tok.convert_tokens_to_ids(token) for key, token in MEDIA_TOKENS.items()}
    if any(i is None or i < 0 or i == tok.unk_token_id for i in ids.values()):
        raise ValueError(f"{ckpt}: the tokenizer lacks a media token: {ids}")
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    for part in ("thinker_config", "talker_config"):
        cfg[part].update({k: v for k, v in ids.items() if k in cfg[part]})
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return ids


def serve(args) -> None:
    """`--serve`: build or reuse the checkpoint, then serve it until SIGTERM."""
    import dataclasses

    import torch
    import uvicorn

    from benchmarks.qwen2_5_omni_pipeline_gpu import build_checkpoint
    from omnistage.entrypoints.async_llm import AsyncOmniLLM
    from omnistage.entrypoints.openai.server import build_app
    from omnistage.entrypoints.openai.serving import ServerConfig

    dev = torch.device(args.device)
    built = build_checkpoint(Path(args.ckpt), args.small, dev)
    built["media_ids"] = align_media_ids(Path(args.ckpt))
    print(json.dumps({"checkpoint": built}), flush=True)
    if args.build_only:
        return
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    llm = AsyncOmniLLM(args.ckpt, device=args.device,
                       **({"max_model_len": args.max_model_len} if args.max_model_len else {}))
    thinker, talker = llm.stage_names[:2]
    d = llm.pipeline.default_params  # long answers: every one is interrupted while speaking
    d[thinker] = dataclasses.replace(d[thinker], min_tokens=args.text_tokens,
                                     max_tokens=args.text_tokens)
    d[talker] = dataclasses.replace(d[talker], min_tokens=args.codes, max_tokens=args.codes)
    cfg = ServerConfig(served_model_names=[MODEL], max_audio_seconds=120)
    app = build_app(llm, cfg)
    lag = LoopLag()
    app.get("/bench/loop_lag", include_in_schema=False)(lag.report)
    if args.profile_server:
        import cProfile
        profiler = cProfile.Profile()  # (uvicorn runs the event loop on this thread)

        async def dump_profile() -> dict:  # (uvicorn ends the process by the signal it got)
            profiler.disable()
            profiler.dump_stats(args.profile_server)
            return {"written": args.profile_server}

        app.get("/bench/profile", include_in_schema=False)(dump_profile)
        profiler.enable()
    try:
        # (no keepalive pings either way: a loaded client's late pong would end the session)
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning",
                    ws_ping_interval=None, ws_per_message_deflate=args.ws_deflate == "on")
    finally:
        llm.shutdown()


class LoopLag:
    """The server event loop's lag: a 5 ms timer's lateness, sampled from the first report()
    on; report() gives the samples since the previous report and starts over."""

    PERIOD = 0.005

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.task: asyncio.Task | None = None

    async def _watch(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.PERIOD)
            self.samples.append(1e3 * (time.perf_counter() - t - self.PERIOD))

    async def report(self) -> dict:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._watch())
        v, self.samples = self.samples, []
        q = {f"p{round(100 * f)}": round(x, 1) if (x := pct(v, f)) is not None else None
             for f in (0.5, 0.9, 0.99)}
        return {"samples": len(v), **q, "max": round(max(v), 1) if v else None,
                "busy_over_20ms_s": round(sum(x for x in v if x > 20) / 1e3, 2)}


# ------------------------------------------------------------------ the client
def speech_clip() -> tuple[np.ndarray, int]:
    """question.wav (16 kHz pcm16) at 24 kHz int16, and the sample of its onset."""
    from omnistage.models.qwen2_5_omni.media import resample
    with wave.open(str(CLIP)) as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ValueError(f"{CLIP}: expected mono pcm16")
        sr, raw = w.getframerate(), w.readframes(w.getnframes())
    x = resample(np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0, sr, RATE)
    onset = int(np.argmax(np.abs(x) > 0.02 * np.abs(x).max()))
    return np.round(np.clip(x, -1, 1) * 32767).astype(np.int16), onset


def _b64(pcm: np.ndarray) -> str:
    return base64.b64encode(pcm.astype("<i2").tobytes()).decode()


def stages_idle(url: str) -> bool:
    """Every stage on /metrics: nothing running or queued, every KV block free."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    values: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("omnistage_stage_") and "{" in line:
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("}", 1)
            values.setdefault(labels, {})[name] = float(value)
    for v in values.values():
        if v.get("omnistage_stage_running_requests", 0) or \
                v.get("omnistage_stage_queue_depth", 0):
            return False
        total = v.get("omnistage_stage_kv_blocks_total")
        if total is not None and v.get("omnistage_stage_kv_blocks_free") != total:
            return False
    return bool(values)


async def session(url: str, clip: np.ndarray, onset: int, turns: int, args,
                  watch_idle: bool) -> dict:
    """One voice session (module note); its per-turn samples."""
    import websockets
    ws_url = url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
    out: dict = {"turns": [], "barge_ins": [], "errors": []}
    # (no keepalive pings: a busy server's late pong is not what this measures)
    async with websockets.connect(ws_url, max_size=None, ping_interval=None) as ws:
        async def recv() -> dict:
            return json.loads(await asyncio.wait_for(ws.recv(), args.event_timeout))

        if (await recv())["type"] != "session.created":
            raise RuntimeError("no session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {
            "max_output_tokens": args.text_tokens,
            "audio": {"input": {"turn_detection": {
                "type": "server_vad", "threshold": 0.5, "silence_duration_ms": args.silence_ms,
                "prefix_padding_ms": 300, "create_response": True,
                "interrupt_response": True}}}}}))
        while (ev := await recv())["type"] != "session.updated":
            if ev["type"] == "error":
                raise RuntimeError(ev["error"]["message"])
        queue: list[np.ndarray] = []  # speech waiting for the microphone
        marks: dict[str, float] = {}

        async def microphone() -> None:
            t0, n, pos, spoken = time.perf_counter(), 0, 0, None
            while True:
                if spoken is None and queue:
                    spoken, pos = queue.pop(0), 0
                if spoken is not None:
                    chunk = spoken[pos:pos + CHUNK]
                    if pos <= onset < pos + CHUNK:
                        marks["onset"] = time.perf_counter()
                    pos += CHUNK
                    if pos >= len(spoken):
                        spoken = None
                else:
                    chunk = np.zeros(CHUNK, np.int16)
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": _b64(chunk)}))
                n += 1
                await asyncio.sleep(max(0.0, t0 + n * CHUNK / RATE - time.perf_counter()))

        mic = asyncio.get_running_loop().create_task(microphone())
        queue.append(clip)
        turn, first_audio_seen, barge_pending = 0, False, False
        watchers: list[asyncio.Task] = []
        try:
            while True:
                ev = await recv()
                now, kind = time.perf_counter(), ev["type"]
                if kind == "error":
                    out["errors"].append(ev["error"]["message"])
                elif kind == "input_audio_buffer.speech_started":
                    marks["started"] = now
                elif kind == "input_audio_buffer.speech_stopped":
                    marks["stopped"] = now
                elif kind == "input_audio_buffer.committed":
                    marks["committed"] = now
                elif kind == "response.created":
                    first_audio_seen = False
                elif kind == "response.output_audio.delta" and not first_audio_seen:
                    first_audio_seen = True
                    turn += 1
                    out["turns"].append({
                        "commit_to_audio_ms": round(1e3 * (now - marks["committed"]), 1),
                        "stopped_to_audio_ms": round(1e3 * (now - marks["stopped"]), 1)})
                    if turn < turns:  # talk over the answer: the barge-in and the next turn
                        marks.pop("onset", None)
                        queue.append(clip)
                        barge_pending = True
                    else:
                        await ws.send(json.dumps({"type": "response.cancel"}))
                elif kind == "response.done":
                    status = ev["response"]["status"]
                    if barge_pending and status == "cancelled" and "onset" in marks:
                        barge_pending = False
                        sample = {
                            "onset_to_cancelled_ms": round(1e3 * (now - marks["onset"]), 1),
                            "started_to_cancelled_ms": round(1e3 * (now - marks["started"]),
                                                             1)}
                        if watch_idle:
                            watchers.append(asyncio.get_running_loop().create_task(
                                watch_idle_after(url, sample, marks["onset"], marks)))
                        out["barge_ins"].append(sample)
                    elif barge_pending:
                        out["errors"].append(f"response ended {status} before the barge-in")
                        barge_pending = False
                    if turn >= turns:
                        break
            await asyncio.gather(*watchers)
        finally:
            mic.cancel()
            await asyncio.gather(mic, return_exceptions=True)
    return out


async def watch_idle_after(url: str, sample: dict, onset: float, marks: dict) -> None:
    """onset_to_idle_ms into `sample` once every stage is idle; left out when the next turn's
    commit comes first (a slow machine: the next answer then keeps the stages busy)."""
    while not await asyncio.to_thread(stages_idle, url):
        if marks.get("committed", 0.0) > onset:
            return
        await asyncio.sleep(0.002)
    sample["onset_to_idle_ms"] = round(1e3 * (time.perf_counter() - onset), 1)


def pct(values: list[float], q: float) -> float | None:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else None


def summary(sessions: list[dict]) -> dict:
    turns = [t for s in sessions for t in s["turns"]]
    barges = [b for s in sessions for b in s["barge_ins"]]
    out: dict = {"turns": len(turns), "barge_ins": len(barges),
                 "errors": [e for s in sessions for e in s["errors"]]}
    for key in ("commit_to_audio_ms", "stopped_to_audio_ms"):
        vals = [t[key] for t in turns]
        out[key] = {"p50": pct(vals, 0.5), "p90": pct(vals, 0.9), "max": max(vals, default=None)}
    for key in ("onset_to_cancelled_ms", "started_to_cancelled_ms", "onset_to_idle_ms"):
        vals = [b[key] for b in barges if key in b]
        if vals:
            out[key] = {"p50": pct(vals, 0.5), "p90": pct(vals, 0.9), "max": max(vals)}
    return out


def loop_lag(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/bench/loop_lag", timeout=30).read())


async def level(url: str, n: int, clip: np.ndarray, onset: int, turns: int, args) -> dict:
    await asyncio.to_thread(loop_lag, url)  # (starts the samples over)
    t0 = time.perf_counter()
    sessions = await asyncio.gather(*(session(url, clip, onset, turns, args, n == 1)
                                      for _ in range(n)))
    wall = round(time.perf_counter() - t0, 1)
    return {"wall_s": wall, **summary(list(sessions)),
            "loop_lag_ms": await asyncio.to_thread(loop_lag, url)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="the tiny config on the CPU")
    ap.add_argument("--ckpt", default="/tmp/omni7b")
    ap.add_argument("--device", default=None, help="default: cpu with --small, else cuda")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--turns", type=int, default=8, help="turns per session (>= 2)")
    ap.add_argument("--warmup-turns", type=int, default=3)
    ap.add_argument("--text-tokens", type=int, default=256)
    ap.add_argument("--codes", type=int, default=2000)
    ap.add_argument("--silence-ms", type=int, default=500, help="server VAD silence_duration_ms")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    ap.add_argument("--event-timeout", type=float, default=120.0)
    ap.add_argument("--startup-timeout", type=float, default=1800.0)
    ap.add_argument("--server-log", default="/tmp/omnistage_realtime_gpu_server.log")
    ap.add_argument("--build-only", action="store_true",
                    help="build (or reuse) --ckpt and exit (splits a first run in two)")
    ap.add_argument("--profile-server", default=None, metavar="PATH",
                    help="cProfile the server's event-loop thread into PATH (pstats)")
    ap.add_argument("--ws-deflate", choices=["on", "off"], default="on",
                    help="permessage-deflate on the server's WebSockets (uvicorn's default: on; "
                         "it deflates every audio delta on the event loop)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.device = args.device or ("cpu" if args.small else "cuda")
    args.levels = [int(c) for c in args.concurrency.split(",") if c]
    if args.turns < 2 or not args.levels or min(args.levels) < 1:
        ap.error("--turns must be >= 2 and --concurrency positive integers")
    if args.serve or args.build_only:
        serve(args)
        return
    load = os.getloadavg()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--port", str(port),
           "--ckpt", args.ckpt, "--device", args.device, "--concurrency", args.concurrency,
           "--text-tokens", str(args.text_tokens), "--codes", str(args.codes),
           "--ws-deflate", args.ws_deflate,
           *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else []),
           *(["--small"] if args.small else []),
           *(["--profile-server", args.profile_server] if args.profile_server else [])]
    clip, onset = speech_clip()
    result: dict = {"benchmark": "realtime_gpu", "date": datetime.date.today().isoformat(),
                    "config": {k: v for k, v in vars(args).items()
                               if k not in ("serve", "port", "out")}}
    result["config"].update({"clip_s": round(len(clip) / RATE, 2),
                             "clip_onset_ms": round(1e3 * onset / RATE, 1),
                             "platform": platform.platform(), "chunk_ms": 20})
    log = open(args.server_log, "w")  # noqa: SIM115 - closed below
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: see {args.server_log}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                    break
            except OSError:
                pass
            if time.perf_counter() - t0 > args.startup_timeout:
                raise RuntimeError(f"server not up after {args.startup_timeout} s")
            time.sleep(0.5)
        result["startup_to_health_s"] = round(time.perf_counter() - t0, 1)
        t1 = time.perf_counter()
        result["warmup"] = asyncio.run(level(url, 1, clip, onset, args.warmup_turns, args))
        print(f"warm-up: {result['warmup']['wall_s']} s", file=sys.stderr, flush=True)
        for n in args.levels:
            result[f"c{n}"] = asyncio.run(level(url, n, clip, onset, args.turns, args))
            print(f"c{n}: {json.dumps(result[f'c{n}'])}", file=sys.stderr, flush=True)
        result["measure_s"] = round(time.perf_counter() - t1, 1)
        if args.profile_server:
            urllib.request.urlopen(url + "/bench/profile", timeout=120).read()
    finally:
        stop_server(proc, log)
    write_result(result, args.out, load)


if __name__ == "__main__":
    main()
