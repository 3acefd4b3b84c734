"""CPU concurrency: N simultaneous text -> text + audio requests on the tiny Qwen2.5-Omni.

Fixed lengths (thinker 32 tokens, talker 128 codes = 2.56 s of audio per request), greedy,
the same chat prompts everywhere. Systems (timings include prompt processing):
  omnistage_stream      AsyncOmniLLM, all N submitted at once with asyncio; code2wav streams
                        24-frame chunks; TTFA = first audio chunk seen by the client
  omnistage_stream_single   the same, one request at a time, on the first --stream-single
                        prompts (streaming TTFA of an unloaded system)
  omnistage_stream_foreground  diagnostic: OmniLLM with the streaming code2wav (default window),
                        all N in one generate(): the same runtime driven in the caller's thread
                        instead of a background one; TTFA = the runtime's first-chunk time
                        (the chunks are produced, only delivered at the end)
  omnistage_oneshot     OmniLLM(code2wav_window=None), one generate() with all N: each
                        utterance's audio is decoded whole once its last code exists
  omnistage_oneshot_single  the same, one request per generate() call
  hf_single             transformers' Qwen2_5OmniForConditionalGeneration.generate, one prompt
                        at a time (returns the waveform at the end)
  hf_batch              the same on left-padded batches of --hf-batch (16 if that fails)
Accounting per request: TTFA and e2e from submit, RTF = e2e / audio seconds. Systems that return
audio only at the end have TTFA = e2e. Systems that serve requests one call at a time are
reported twice: `isolated` (each call's own time: an unloaded system) and `queued` (all N arrive
at t=0 and are served in order: call i finishes after calls 0..i).

Streaming systems also report `playback_stall_s`: the seconds a client that starts playing at
the first chunk and plays chunks back to back spends waiting for the next one (0 = real time).

AsyncOmniLLM's runtime thread is started per streaming unit and stopped after it (see
stream_round: a live runtime thread slows torch in the main thread, i.e. every other system).

Timing: after a warm-up, every unit (a concurrent round, one single call, one HF batch) runs
--repeats times, the systems interleaved round by round, plus up to --extra-runs rounds of units
whose runs were all contended; a unit's fastest uncontended run counts (its per-request numbers
come from that run).

Usage: python benchmarks/cpu_concurrency.py [--requests 32] [--thinker-tokens 32]
         [--talker-codes 128] [--hf-batch 32] [--stream-single 8] [--threads N]
         [--repeats 2] [--extra-runs 1] [--out FILE]
Prints one JSON object to stdout (and writes it to --out)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402
from benchmarks.cpu_omni import (  # noqa: E402
    CONTENDED,
    SAMPLE_RATE,
    HFRunner,
    Result,
    Stopwatch,
    agreement,
    code2wav_batch_sizes,
    contended,
    cpu_model,
    make_prompts,
    omni_params,
)


@dataclass
class Req:
    """One request's timings (seconds from its unit's start) and what it produced."""

    ttfa: float
    e2e: float
    result: Result
    chunks: int = 1
    ttft: float | None = None
    stall: float | None = None  # streaming: playback stall seconds (see playback_stall)
    round_stats: dict | None = None  # omnistage calls, on the first request (see round_stats)


def snapshot(llm) -> tuple[dict[str, float], int]:
    """Busy seconds per stage so far, and code2wav batches so far."""
    busy = {k: v["busy_seconds"] for k, v in llm.runtime.stats().items()}
    return busy, len(code2wav_batch_sizes(llm.pipeline))


def round_stats(llm, before: tuple[dict[str, float], int]) -> dict:
    """Stage busy seconds and code2wav batch sizes of one call (stages run one after another
    in the runtime loop, so busy seconds add up to the loop's compute time)."""
    busy, _ = snapshot(llm)
    return {"stage_busy_s": {k: round(v - before[0][k], 3) for k, v in busy.items()},
            "code2wav_batch_sizes": code2wav_batch_sizes(llm.pipeline)[before[1]:]}


# ---------------------------------------------------------------- omnistage
async def _stream_round(llm, prompts: list[list[dict]], params: dict) -> list[Req]:
    """Every prompt submitted at once; client-side times of the first audio chunk and the end."""
    before = snapshot(llm)
    t0 = time.perf_counter()

    async def one(messages: list[dict]) -> Req:
        ttft = ttfa = out = None
        chunks: list[np.ndarray] = []
        arrivals: list[float] = []
        async for out in llm.generate({"messages": messages}, params):
            now = time.perf_counter() - t0
            if ttft is None and out.token_ids:
                ttft = now
            if out.audio is not None and len(out.audio):
                ttfa = now if ttfa is None else ttfa
                chunks.append(out.audio)
                arrivals.append(now)
        e2e = time.perf_counter() - t0
        if out is None or out.error:
            raise RuntimeError(f"omnistage stream request failed: {out and out.error}")
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        whole = out.stages["code2wav"].audio
        if whole is None or len(whole) != len(audio):  # deltas must add up to the utterance
            raise RuntimeError("streamed chunks do not add up to the final audio")
        res = Result(out.token_ids, out.stages["talker"].token_ids, audio)
        stall = playback_stall(arrivals, [len(c) for c in chunks]) if chunks else None
        return Req(ttfa if ttfa is not None else e2e, e2e, res, len(chunks), ttft, stall)

    reqs = list(await asyncio.gather(*(one(m) for m in prompts)))
    reqs[0].round_stats = round_stats(llm, before)
    return reqs


def playback_stall(arrivals: list[float], samples: list[int]) -> float:
    """Seconds a client that plays chunks back to back from the first one waits for audio."""
    play, stall = arrivals[0], 0.0
    for a, n in zip(arrivals, samples):
        start = max(play, a)
        stall += start - play
        play = start + n / SAMPLE_RATE
    return stall


def stream_round(llm, prompts: list[list[dict]], params: dict) -> list[Req]:
    """One round on a fresh runtime thread, stopped after it (same pipeline and weights).

    NOTE: once the runtime thread has run torch ops it owns a second OpenMP team; while that
    thread lives, torch in the main thread ran ~2x slower here (libgomp oversubscribed:
    4 threads on 2 cores), which would slow every other system measured in this process."""
    from omnistage.runtime.orchestrator import Orchestrator

    llm.runtime = Orchestrator(llm.pipeline.workers, background=True)
    try:
        return asyncio.run(_stream_round(llm, prompts, params))
    finally:
        llm.runtime.shutdown()


def oneshot_call(llm, prompts: list[list[dict]], params: dict) -> list[Req]:
    """One OmniLLM.generate call. The runtime's e2e counts from when the loop takes the request;
    the call's extra time (prompt processing before the loop) is added to every request."""
    before = snapshot(llm)
    t0 = time.perf_counter()
    outs = llm.generate([{"messages": m} for m in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"omnistage request failed: {bad[0]}")
    lead = wall - max(o.metrics.e2e for o in outs)  # submit -> the loop's arrival
    reqs = [Req(lead + o.metrics.ttfa, lead + o.metrics.e2e,
                Result(o.token_ids, o.stages["talker"].token_ids, o.audio),
                ttft=lead + o.metrics.ttft) for o in outs]
    reqs[0].round_stats = round_stats(llm, before)
    return reqs


def hf_call(hf: HFRunner, batch: list[list[dict]]) -> list[Req]:
    """transformers returns text and waveform together at the end: TTFA = e2e = the call."""
    t0 = time.perf_counter()
    results = hf.generate(batch)
    wall = time.perf_counter() - t0
    return [Req(wall, wall, r) for r in results]


# ---------------------------------------------------------------- timing
@dataclass
class Unit:
    watch: Stopwatch  # the counted run
    reqs: list[Req]  # that run's requests
    tries: int


def measure(systems: dict[str, list[Callable[[], list[Req]]]], repeats: int, extra: int
            ) -> dict[str, list[Unit]]:
    """Interleaved rounds (see cpu_omni.measure), keeping each run's per-request output, since
    the counted run's latencies are what gets reported."""
    runs: dict[str, list[list[tuple[Stopwatch, list[Req]]]]] = {
        k: [[] for _ in fns] for k, fns in systems.items()}

    def once(k: str, i: int) -> None:
        with Stopwatch() as watch:
            out = systems[k][i]()
        runs[k][i].append((watch, out))

    for _ in range(repeats):
        for k, fns in systems.items():
            for i in range(len(fns)):
                once(k, i)
    for _ in range(extra):
        for k, i in [(k, i) for k, rs in runs.items() for i, r in enumerate(rs)
                     if all(contended(w) for w, _ in r)]:
            once(k, i)

    def best(r: list[tuple[Stopwatch, list[Req]]]) -> Unit:
        w, out = min([x for x in r if not contended(x[0])] or r, key=lambda x: x[0].wall)
        return Unit(w, out, len(r))
    return {k: [best(r) for r in rs] for k, rs in runs.items()}


def dist(xs: list[float]) -> dict:
    a = np.asarray(xs, dtype=np.float64)
    out = {f"p{q}": round(float(np.percentile(a, q)), 4) for q in (50, 90, 99)}
    return {**out, "min": round(float(a.min()), 4), "max": round(float(a.max()), 4)}


def latency(reqs: list[tuple[float, float, float]]) -> dict:
    """(ttfa, e2e, audio seconds) per request -> TTFA / e2e distributions, RTF = e2e / audio."""
    return {"ttfa_s": dist([r[0] for r in reqs]), "e2e_s": dist([r[1] for r in reqs]),
            "rtf": dist([r[1] / r[2] for r in reqs])}


def summarize(units: list[Unit], sequential_units: bool) -> dict:
    """sequential_units: the units are calls served one after another (queued accounting)."""
    wall = sum(u.watch.wall for u in units)
    reqs = [r for u in units for r in u.reqs]
    audio = [len(r.result.audio) / SAMPLE_RATE for r in reqs]
    out = {"requests": len(reqs), "wall_s": round(wall, 4),
           "requests_per_s": round(len(reqs) / wall, 3),
           "audio_seconds": round(sum(audio), 3),
           "audio_seconds_per_s": round(sum(audio) / wall, 3)}
    own = [(r.ttfa, r.e2e, a) for r, a in zip(reqs, audio)]
    if not sequential_units:
        out.update(latency(own))
    else:
        out["isolated"] = latency(own)
        starts = np.cumsum([0.0] + [u.watch.wall for u in units[:-1]])
        queued = [(s + r.ttfa, s + r.e2e) for s, u in zip(starts, units) for r in u.reqs]
        out["queued"] = latency([(q[0], q[1], a) for q, a in zip(queued, audio)])
    ttft = [r.ttft for r in reqs if r.ttft is not None]
    if ttft and not sequential_units:  # text, for reference
        out["ttft_s"] = dist(ttft)
    out.update(timed_units=len(units), runs=sum(u.tries for u in units),
               contended_units=sum(contended(u.watch) for u in units),
               cpu_per_wall=round(sum(u.watch.cpu for u in units) / wall, 2),
               others_cpu_per_wall=round(sum(u.watch.others for u in units) / wall, 2))
    return out


def check_lengths(name: str, reqs: list[Req], args: argparse.Namespace) -> None:
    """Every system must produce exactly the configured lengths (else the comparison is void)."""
    for i, r in enumerate(reqs):
        n_audio = args.talker_codes * 2 * 240
        got = (len(r.result.text_ids), len(r.result.codes), len(r.result.audio))
        if got != (args.thinker_tokens, args.talker_codes, n_audio):
            raise RuntimeError(f"{name} request {i}: (text, codes, samples) = {got}, expected "
                               f"{(args.thinker_tokens, args.talker_codes, n_audio)}")


def snr_db(ref: np.ndarray, x: np.ndarray) -> float:
    noise = float(np.sum((ref - x) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(ref ** 2)) / noise)


# ---------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--thinker-tokens", type=int, default=32)
    ap.add_argument("--talker-codes", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=32, help="falls back to 16 if it fails")
    ap.add_argument("--stream-single", type=int, default=8,
                    help="prompts for omnistage_stream_single (0 = skip)")
    ap.add_argument("--no-foreground-stream", dest="foreground_stream", action="store_false",
                    help="skip omnistage_stream_foreground")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--extra-runs", type=int, default=1)
    ap.add_argument("--model-dir", type=str, default=None)
    ap.add_argument("--out", type=str, default=None)
    args = ap.parse_args()
    for name in ("requests", "thinker_tokens", "talker_codes", "hf_batch", "threads", "repeats"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be positive")
    if args.extra_runs < 0 or args.stream_single < 0:
        raise ValueError("--extra-runs, --stream-single: must be >= 0")
    # what cpu_omni's helpers read
    args.mode, args.ignore_eos = "speech", False
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)  # before the runtimes start (they keep this count)
    import transformers

    transformers.logging.set_verbosity_error()
    from omnistage import AsyncOmniLLM, OmniLLM
    from omnistage.testing.tiny_omni import build_tiny_omni

    tmp = None if args.model_dir else tempfile.TemporaryDirectory()
    path = build_tiny_omni(Path(args.model_dir or tmp.name) / "tiny-omni-bench", seed=0)
    N = args.requests
    prompts = make_prompts("speech", N)
    warmup = make_prompts("speech", max(args.hf_batch, 2), offset=50)
    params = omni_params(args)
    load_before = os.getloadavg()
    t_start = time.perf_counter()

    opts = dict(device="cpu", dtype="float32", talker_handoff="transformers5",
                enable_prefix_caching=False)
    stream_llm = AsyncOmniLLM(str(path), **opts)
    stream_llm.shutdown()  # stream_round starts a runtime thread per round
    oneshot_llm = OmniLLM(str(path), code2wav_window=None, **opts)
    fg_llm = OmniLLM(str(path), **opts) if args.foreground_stream else None
    hf = HFRunner(path, args)
    stream_round(stream_llm, warmup[:2], params)
    oneshot_call(oneshot_llm, warmup[:2], params)
    if fg_llm is not None:
        oneshot_call(fg_llm, warmup[:2], params)
    hf_call(hf, warmup[:1])
    hf_batch, batch_error = args.hf_batch, None
    try:  # whether transformers' Omni generate takes a batch this large is part of the result
        hf_call(hf, warmup[:hf_batch])
    except Exception as e:  # noqa: BLE001 (recorded in the JSON, then 16 is tried)
        batch_error = f"batch {hf_batch}: {type(e).__name__}: {e}"
        hf_batch = 16
        hf_call(hf, warmup[:hf_batch])

    systems: dict[str, list[Callable[[], list[Req]]]] = {
        "omnistage_stream": [lambda: stream_round(stream_llm, prompts, params)],
        "omnistage_stream_single": [lambda m=m: stream_round(stream_llm, [m], params)
                                    for m in prompts[:args.stream_single]],
        "omnistage_stream_foreground": [lambda: oneshot_call(fg_llm, prompts, params)]
        if fg_llm is not None else [],
        "omnistage_oneshot": [lambda: oneshot_call(oneshot_llm, prompts, params)],
        "omnistage_oneshot_single": [lambda m=m: oneshot_call(oneshot_llm, [m], params)
                                     for m in prompts],
        "hf_single": [lambda m=m: hf_call(hf, [m]) for m in prompts],
        "hf_batch": [lambda i=i: hf_call(hf, prompts[i:i + hf_batch])
                     for i in range(0, N, hf_batch)],
    }
    systems = {k: fns for k, fns in systems.items() if fns}
    timed = measure(systems, args.repeats, args.extra_runs)
    for llm in (stream_llm, oneshot_llm, fg_llm):
        if llm is not None:
            llm.shutdown()

    sequential = {"omnistage_stream_single", "omnistage_oneshot_single", "hf_single",
                  "hf_batch"}
    for k, units in timed.items():
        check_lengths(k, [r for u in units for r in u.reqs], args)
    res = {k: summarize(units, k in sequential) for k, units in timed.items()}
    for k, units in timed.items():  # the counted runs' runtime stats
        stats = [u.reqs[0].round_stats for u in units if u.reqs[0].round_stats]
        if not stats:
            continue
        if k in sequential:
            res[k]["stage_busy_s_mean_per_call"] = {s: round(float(np.mean(
                [x["stage_busy_s"][s] for x in stats])), 3) for s in stats[0]["stage_busy_s"]}
        else:
            res[k].update(stats[0])
        if k.startswith("omnistage_stream") and k != "omnistage_stream_foreground":
            reqs = [r for u in units for r in u.reqs]
            res[k]["audio_chunks_per_request"] = dist([r.chunks for r in reqs])
            res[k]["playback_stall_s"] = dist([r.stall for r in reqs])
    res["hf_batch"]["batch_size"] = hf_batch
    if batch_error:
        res["hf_batch"]["first_try_error"] = batch_error
    outs = {k: [r.result for u in units for r in u.reqs] for k, units in timed.items()}
    one = outs["omnistage_oneshot"]
    checks = {f"{k}_vs_hf_single": agreement(outs[k], outs["hf_single"])
              for k in ("omnistage_stream", "omnistage_stream_foreground", "omnistage_oneshot",
                        "hf_batch") if k in outs}
    snrs = [snr_db(a.audio, b.audio) for a, b in zip(one, outs["omnistage_stream"])
            if a.codes == b.codes]
    checks["stream_vs_oneshot_audio_snr_db"] = dist(snrs) if snrs else None

    result = {
        "benchmark": "cpu_concurrency",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": {
            "model": "tiny random Qwen2.5-Omni (omnistage.testing.tiny_omni, seed 0)",
            "dtype": "float32", "requests": N,
            "prompts": "one text user turn each (Zen of Python lines cycled + 'Say it aloud.'); "
                       "Qwen's audio system prompt",
            "thinker_tokens_per_request": args.thinker_tokens,
            "talker_codes_per_request": args.talker_codes,
            "audio_seconds_per_request": args.talker_codes * 480 / SAMPLE_RATE,
            "decoding": "greedy (talker repetition_penalty 1.05, codec bos 121 suppressed)",
            "omnistage_length_control": "thinker and talker min_tokens=max_tokens; talker "
                                        "stop_token_ids=TINY_TALKER_EOS",
            "hf_length_control": "thinker/talker min_new_tokens=max_new_tokens",
            "omnistage_talker_handoff": "transformers5", "omnistage_prefix_caching": False,
            "omnistage_stream_code2wav": "default window: 24-frame (12-code, 0.24 s) chunks, "
                                         "past 2 / future 1 blocks, 20 vocoder frames",
            "includes_prompt_processing": True,
            "latency_accounting": " ".join(__doc__.split("Accounting per request: ")[1].split(
                "\n\nTiming")[0].split()),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(), "repeats": args.repeats,
            "extra_runs": args.extra_runs,
            "contended_means": f"other processes used >= {CONTENDED} CPU-s per wall-s",
        },
        **res,
        "checks": checks,
        "any_contended_units": any(r["contended_units"] for r in res.values()),
    }
    result["config"]["benchmark_wall_s"] = round(time.perf_counter() - t_start, 1)
    write_result(result, args.out, load_before)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
