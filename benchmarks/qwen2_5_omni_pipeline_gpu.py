"""The whole Qwen2.5-Omni pipeline end to end on the GPU, through the real runtime: a random-weight
checkpoint at real 7B shapes is saved in the released layout (sharded safetensors, spk_dict.pt,
tokenizer and processor files, generation_config.json), loaded with AsyncOmniLLM, and served a
text prompt (~60 ids) -> 128 text tokens + 1024 codec codes per request, all requests of a
round submitted at once (closed loop, concurrency c).

Per request: TTFT (first text token), TTFA (first audio chunk), e2e, RTF = e2e / audio seconds
(runtime metrics, from the request's arrival in the runtime); per round: audio-seconds per
second, each stage's busy seconds and steps (where the loop's time goes), peak memory.
`--small` runs the same code on a tiny config with the real vocabularies and token ids (CPU
smoke test)."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import faulthandler
import importlib.machinery
import io
import json
import logging
import os
import pstats
import shutil
import statistics
import sys
import time
import types
from pathlib import Path

import torch

try:
    import soundfile  # noqa: F401
except ImportError:  # the GPU machine lacks it; nothing here reads audio files
    sys.modules["soundfile"] = types.ModuleType("soundfile")
    sys.modules["soundfile"].__spec__ = importlib.machinery.ModuleSpec("soundfile", None)

from benchmarks.common import parse_stage_devices, pipeline_yaml  # noqa: E402
from omnistage.entrypoints.async_llm import AsyncOmniLLM  # noqa: E402
from omnistage.sampling_params import SamplingParams  # noqa: E402
from omnistage.runtime.stage import StageStream  # noqa: E402

SR = 24000
ROUND_TIMEOUT_S = {"seconds": 240.0}  # --round-timeout-s
MARKER = "pipeline_bench_build.json"
HF_H100 = {"bs1_rtf": 5.285, "bs1_first_audio_s": 108.23, "bs8_audio_s_per_s": 1.641,
           "bs32_audio_s_per_s": 3.273}
# --staggered-modes: code2wav policies of a staggered round (unset: the stage's own)
STAGGERED_MODES = {"default": {}, "first_shared": {"first_alone": False}}
# extra rounds: the args attribute listing their concurrencies -> (mode, round name suffix)
ROUND_MODES = {"serial": ("serial", "_serial_steps"),
               "sync_sched": ("sync", "_no_async_scheduling"),
               "staggered": ("staggered", "_staggered"),
               "first_shared": ("first_shared", "_first_chunk_shared"),
               "ar_streams_shared": ("ar_shared", "_ar_stream_shared"),
               "ar_streams_flat": ("ar_flat", "_ar_streams_one_priority"),
               "eager_prefill": ("eager_prefill", "_eager_prefill"),
               "code2wav_inline": ("c2w_inline", "_code2wav_inline_launch")}
MODE_SUFFIX = dict(ROUND_MODES.values())
TARGETS = {"ttfa_s_c1": 0.25, "rtf_c1": 0.10, "audio_s_per_s_c32": 65.0}


def real_config():
    from transformers import Qwen2_5OmniConfig
    return Qwen2_5OmniConfig(
        # the released vision tower (1280 wide; transformers' default config is 3584 wide)
        thinker_config=dict(vision_start_token_id=151652, vision_end_token_id=151653,
                            vision_config=dict(hidden_size=1280, intermediate_size=3420,
                                               depth=32, num_heads=16, out_hidden_size=3584)),
        talker_config=dict(vision_start_token_id=151652, hidden_size=896, num_hidden_layers=24,
                           num_attention_heads=12, num_key_value_heads=4, head_dim=128,
                           intermediate_size=18944, embedding_size=3584, vocab_size=8448),
        token2wav_config=dict(dit_config=dict(num_embeds=8448)))


def small_config(tok):
    """The tiny test config's sizes with the real vocabularies and special ids."""
    from transformers import Qwen2_5OmniConfig

    from omnistage.testing.tiny_omni import build_tiny_config
    real, small = real_config().to_dict(), build_tiny_config(tok).to_dict()
    for part in ("thinker_config", "talker_config"):
        for k, v in real[part].items():
            if ("token" in k and (k.endswith("_id") or k.endswith("_index"))) and v is not None:
                small[part][k] = v
    small["thinker_config"]["text_config"]["vocab_size"] = 152064
    small["talker_config"]["vocab_size"] = 8448
    small["token2wav_config"]["dit_config"]["num_embeds"] = 8448
    return Qwen2_5OmniConfig(**{k: small[k] for k in
                                ("thinker_config", "talker_config", "token2wav_config")})


def fill_vocab(tokenizer_json: Path, vocab_size: int) -> int:
    """Give every id below vocab_size a text: the tiny tokenizer's BPE knows about 1k ids, and
    random weights at the real vocab sample ids up to 152k, which decoded to nothing, so a
    stream's first text came only when an id under 1k was drawn (TTFT measured luck). Filler
    tokens `<|filler_N|>` (no merge makes them: encoding is unchanged) take the missing ids;
    returns how many were added."""
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    added = 0
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"<|filler_{i}|>"] = i
            added += 1
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))
    return added


def build_checkpoint(out: Path, small: bool, dev: torch.device) -> dict:
    """Random checkpoint in the released layout; reused when its marker matches."""
    # 2: the released vision tower's width; 3: every id of the vocab decodes to text
    args = {"version": 3, "small": small}
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == args:
        return {"reused": True}
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omnistage.testing.tiny_omni import build_tiny_omni, build_tiny_tokenizer
    t0 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    src = build_tiny_omni(out.parent / f"{out.name}-tiny-src")  # tokenizer + processor files
    skip = {"config.json", "generation_config.json", "spk_dict.pt", "tiny_omni_build.json"}
    for f in src.iterdir():
        if f.name not in skip and "safetensors" not in f.name:
            (shutil.copytree if f.is_dir() else shutil.copy)(f, out / f.name)
    cfg = small_config(build_tiny_tokenizer()) if small else real_config()
    fill_vocab(out / "tokenizer.json", cfg.thinker_config.text_config.vocab_size)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):  # random init on the device (fp32: robust), then bf16 in place
        model = Qwen2_5OmniForConditionalGeneration(cfg).eval().to(dtype)
    eos = [151645, 151643]
    model.generation_config.eos_token_id = eos
    params = {n: sum(p.numel() for p in getattr(model, n).parameters())
              for n in ("thinker", "talker", "token2wav")}
    t1 = time.perf_counter()
    model.save_pretrained(out, max_shard_size="5GB")
    t2 = time.perf_counter()
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}) + "\n")
    enc = cfg.token2wav_config.dit_config.enc_emb_dim
    g = torch.Generator().manual_seed(1)
    spk = {name: {"bos_token": bos, "cond": torch.randn(1, enc, generator=g),
                  "ref_mel": torch.randn(1, 300, 80, generator=g)}
           for name, bos in (("Chelsie", 151672), ("Ethan", 151673))}
    torch.save(spk, out / "spk_dict.pt")
    marker.write_text(json.dumps(args) + "\n")
    return {"reused": False, "build_s": round(t1 - t0, 1), "save_s": round(t2 - t1, 1),
            "params": params}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (no prefix-cache hits across requests)."""
    g = torch.Generator().manual_seed(seed)
    im_s, im_e = 151644, 151645
    out = []
    for _ in range(n):  # chat layout: system, user (random body), assistant header
        body = torch.randint(1000, 150000, (length - 13,), generator=g).tolist()
        out.append([im_s, 8948, 198] + body[:4] + [im_e, 198, im_s, 872, 198] + body[4:]
                   + [im_e, 198, im_s, 77091, 198])
    return out


def stage_params(text_tokens: int, codes: int) -> dict[str, SamplingParams]:
    return {"thinker": SamplingParams(temperature=0, min_tokens=text_tokens,
                                      max_tokens=text_tokens, ignore_eos=True),
            "talker": SamplingParams(temperature=0.9, top_k=40, top_p=0.8,
                                     repetition_penalty=1.05, min_tokens=codes, max_tokens=codes,
                                     stop_token_ids=[8292, 8294], suppress_token_ids=[8293])}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one_request(llm: AsyncOmniLLM, ids: list[int], sp: dict, delay_s: float = 0.0
                      ) -> dict:
    await asyncio.sleep(delay_s)
    t_submit = time.perf_counter()
    first_text = first_audio = None
    samples = chunks = 0
    chunk_at: list[float] = []  # when each audio chunk reached the client (s after submit)
    out = None
    async for out in llm.generate({"prompt_token_ids": ids}, sampling_params=sp):
        now = time.perf_counter() - t_submit
        if first_text is None and out.token_ids:
            first_text = now
        if out.audio is not None and len(out.audio):
            first_audio = now if first_audio is None else first_audio
            samples += len(out.audio)
            chunks += 1
            chunk_at.append(now)
    if out.error:
        raise RuntimeError(f"request failed: {out.error}")
    m = out.metrics
    return {"request_id": out.request_id, "t_submit": t_submit, "delay_s": delay_s,
            "ttft": m.ttft, "ttfa": m.ttfa, "e2e": m.e2e, "audio_s": samples / SR,
            "chunks": chunks, "chunk_at": chunk_at, "client_ttft": first_text,
            "client_ttfa": first_audio,
            "client_e2e": time.perf_counter() - t_submit,
            "text_tokens": len(out.token_ids), "codes": m.tokens_per_stage.get("talker")}


C2W_TRACE: list[tuple] = []  # code2wav steps, see trace_code2wav
FIRST_READY: dict[str, float] = {}  # request id -> when its first chunk's codes were all in
FIRST_LAUNCH: dict[str, float] = {}  # request id -> when the step with its first chunk launched


def trace_code2wav(llm: AsyncOmniLLM) -> None:
    """Record each code2wav launch (in this process) as (launch start, launch end, collect
    start, first chunks, later chunks, "step" or "part") perf_counter times, a part's later
    chunks being its step's; and per request when its first chunk became ready and when it was
    launched (FIRST_READY, FIRST_LAUNCH): where a request's time to first audio goes."""
    stage = llm.pipeline.workers.get("code2wav")
    if stage is None or stage.model.stream_config is None:
        return
    launch, collect, add_input = stage.launch, stage.collect, stage.add_input
    started: dict[int, tuple] = {}

    def traced_add_input(request_id: str, codes: list[int], finished: bool) -> None:
        add_input(request_id, codes, finished)
        req = stage.requests.get(request_id)
        if request_id not in FIRST_READY and req is not None and req.stream is not None \
                and req.next_chunk == 0 and req.stream.ready_chunks() > 0:
            FIRST_READY[request_id] = time.perf_counter()

    def traced_launch():
        t = time.perf_counter()
        out = launch()
        if out is not None and out.state is not None:
            ready = out.state[0]
            first = [rid for rid, r in ready if r.next_chunk == 0]
            for rid in first:
                FIRST_LAUNCH.setdefault(rid, t)
            part = not first and stage.job is not None
            later = len(stage.job.ready) if part else len(ready) - len(first)
            started[id(out)] = (t, time.perf_counter(), len(first), later,
                                "part" if part else "step")
        return out

    def traced_collect(launched):
        t = time.perf_counter()
        begun = started.pop(id(launched), None)
        if begun is not None and len(C2W_TRACE) < 100_000:
            C2W_TRACE.append((begun[0], begun[1], t, *begun[2:]))
        return collect(launched)

    stage.launch, stage.collect, stage.add_input = traced_launch, traced_collect, traced_add_input


HOST_CALLS: list[tuple] = []  # (start, seconds, what) of traced host calls
SLOW_CALL_S = 0.1  # calls listed one by one in a round's slow_calls
# --profile-host: a cProfile of the orchestrator thread's traced calls during those rounds
HOST_PROFILE: dict[str, cProfile.Profile | int | None] = {"profile": None, "depth": 0}


def trace_host_calls(llm: AsyncOmniLLM) -> None:
    """Time the stage hosts' launch/collect/step/receive, the orchestrator's event routing and
    code2wav's decoder calls (on the stage's launcher thread): what the host does, and what
    stalls the pipeline."""
    def timed(obj, attr: str, what: str, profiled: bool = True) -> None:
        fn = getattr(obj, attr)

        def run(*a, **kw):
            t = time.perf_counter()
            prof = HOST_PROFILE["profile"] if profiled and not HOST_PROFILE["depth"] else None
            HOST_PROFILE["depth"] += profiled
            if prof is not None:
                prof.enable()
            try:
                return fn(*a, **kw)
            finally:
                if prof is not None:
                    prof.disable()
                HOST_PROFILE["depth"] -= profiled
                if len(HOST_CALLS) < 2_000_000:
                    HOST_CALLS.append((t, time.perf_counter() - t, what))
        setattr(obj, attr, run)

    for name, host in llm.runtime.local.items():
        for attr in ("launch", "collect", "step", "receive"):
            timed(host, attr, f"{name}.{attr}")
    timed(llm.runtime, "_route", "route")  # a stage event to the client and downstream
    stage = llm.pipeline.workers.get("code2wav")
    if stage is not None and stage.model.stream_config is not None:
        for attr in ("decode", "begin_job", "advance", "finish"):  # (the launcher thread's)
            timed(stage.model.decoder, attr, f"decoder.{attr}", profiled=False)


TRITON_COMPILES: list[tuple] = []  # (time, kernel and specialization) of each Triton compile


def trace_triton_compiles() -> None:
    """Record each Triton kernel compiled from now on (a round that compiles shows it)."""
    import triton
    knobs = getattr(triton, "knobs", None)
    if knobs is None:  # older Triton: no compile hook to set
        return

    def hook(*args, **kwargs) -> bool:
        if len(TRITON_COMPILES) < 10_000:
            kernel = str(kwargs.get("repr", "?")).split("[")[0]
            # the key: each argument's type and specialization (e.g. "D": divisible by 16)
            TRITON_COMPILES.append((time.perf_counter(), f"{kernel} {kwargs.get('key')!s:.600}"))
        return False
    knobs.runtime.jit_post_compile_hook = hook


TRITON_BUILDS: list[tuple[str, bool]] = []  # (kernel, cache hit) of each triton.compile


def trace_triton_builds() -> None:
    """Record each triton.compile in this process from now on: compiled, or loaded from the
    on-disk cache (a variant compiled ahead, or by an earlier run)."""
    import triton
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return

    def listener(*, src, cache_hit: bool, **_) -> None:
        TRITON_BUILDS.append((str(getattr(src, "name", "?")), bool(cache_hit)))
    knobs.compilation.listener = listener


def triton_build_counts() -> dict[str, list[int]]:
    """kernel name -> [variants compiled, variants loaded from the cache]."""
    out: dict[str, list[int]] = {}
    for name, hit in TRITON_BUILDS:
        out.setdefault(name, [0, 0])[1 if hit else 0] += 1
    return dict(sorted(out.items()))


def host_call_totals(calls: list[tuple]) -> dict[str, list]:
    """what -> [calls, total host seconds, largest seconds]."""
    out: dict[str, list] = {}
    for _, dt, what in calls:
        n, total, top = out.get(what, (0, 0.0, 0.0))
        out[what] = [n + 1, total + dt, max(top, dt)]
    return {k: [n, round(total, 3), round(top, 4)] for k, (n, total, top) in sorted(out.items())}


def ttfa_parts(rows: list[dict]) -> dict:
    """Where time to first audio went: ar_s (submit -> first chunk's codes in), wait_s (-> its
    step launched), step_s (-> audio at the client); the medians, and the parts of the
    requests with the median and the largest TTFA."""
    parts = []
    for r in rows:
        ready, start = FIRST_READY.get(r["request_id"]), FIRST_LAUNCH.get(r["request_id"])
        if ready is None or start is None or r["client_ttfa"] is None:
            continue
        parts.append({"ttfa_s": round(r["client_ttfa"], 3),
                      "ar_s": round(ready - r["t_submit"], 3), "wait_s": round(start - ready, 3),
                      "step_s": round(r["t_submit"] + r["client_ttfa"] - start, 3),
                      "arrival_s": round(r["delay_s"], 3)})
    if not parts:
        return {}
    by_ttfa = sorted(parts, key=lambda p: p["ttfa_s"])
    return {"median": {k: round(statistics.median(p[k] for p in parts), 3)
                       for k in ("ar_s", "wait_s", "step_s")},
            "p50_request": by_ttfa[len(by_ttfa) // 2], "max_request": by_ttfa[-1]}


def dynamo_frames() -> int:
    """Frames torch.compile has compiled so far (a round that compiles shows a rise)."""
    from torch._dynamo.utils import counters
    return int(counters["frames"]["ok"])


def stage_graphs(llm: AsyncOmniLLM) -> dict[str, float]:
    """Graph counts and capture/compile seconds of code2wav's decoder: a round that captures
    or compiles (a shape the warm-up missed) shows here."""
    stage = llm.pipeline.workers.get("code2wav")
    if stage is None or getattr(getattr(stage, "model", None), "_decoder", None) is None:
        return {}
    return {k: v for k, v in stage.model.decoder.stats().items()
            if k in ("dit_graphs", "vocoder_graphs", "compile_seconds", "capture_seconds",
                     "warmup_seconds")}


def stage_stats(llm: AsyncOmniLLM) -> dict:
    s = llm.runtime.stats()
    return {"busy": {k: v.get("busy_seconds", 0.0) for k, v in s.items()},
            "steps": {k: v.get("steps", 0) for k, v in s.items() if "steps" in v},
            "c2w_chunks": s["code2wav"].get("chunks", 0),
            "c2w_alone": s["code2wav"].get("alone_steps", 0)}


def pending_captures(llm: AsyncOmniLLM) -> dict[str, int]:
    """Graphs a lazy warm-up plan has left per in-process stage (captured in idle passes)."""
    return {name: w.captures_pending() for name, w in llm.pipeline.workers.items()
            if hasattr(w, "captures_pending")}  # (AR and gen stage workers)


async def settle_captures(llm: AsyncOmniLLM, limit_s: float = 300.0) -> float:
    """Waits (idle) until the runtime's idle passes captured every graph a lazy warm-up left;
    returns the seconds waited."""
    t0 = time.perf_counter()
    while any(pending_captures(llm).values()) and time.perf_counter() - t0 < limit_s:
        await asyncio.sleep(0.05)
    return round(time.perf_counter() - t0, 2)


async def run_round(llm: AsyncOmniLLM, c: int, text_tokens: int, codes: int, seed: int,
                    stagger_s: float = 0.0, profile_host: bool = False) -> dict:
    # stagger_s: the requests arrive evenly over this many seconds (0: all at once)
    sp = stage_params(text_tokens, codes)
    ids = prompts(c, 63, seed)
    before = stage_stats(llm)
    compiles_before = dynamo_frames()
    HOST_PROFILE["profile"] = cProfile.Profile() if profile_host else None
    n_trace, n_calls, n_triton = len(C2W_TRACE), len(HOST_CALLS), len(TRITON_COMPILES)
    graphs_before = stage_graphs(llm)
    t0 = time.perf_counter()
    try:
        rows = await asyncio.wait_for(
            asyncio.gather(*[one_request(llm, p, sp, stagger_s * i / c)
                             for i, p in enumerate(ids)]), ROUND_TIMEOUT_S["seconds"])
    except TimeoutError:  # a hung round: say where every thread and stream is, then stop
        faulthandler.dump_traceback()
        print("stuck in flight:", {n: w.describe() for n, w in llm.pipeline.workers.items()
                                   if n in llm.runtime.inflight},
              flush=True)
        os._exit(3)
    wall = time.perf_counter() - t0
    prof, HOST_PROFILE["profile"] = HOST_PROFILE["profile"], None
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        print(f"host profile (orchestrator thread), c{c} stagger {stagger_s} s:\n"
              f"{out.getvalue()[:12000]}", file=sys.stderr, flush=True)
    await asyncio.sleep(0.2)  # stage processes report their stats right after going idle
    after = stage_stats(llm)
    audio = sum(r["audio_s"] for r in rows)
    c2w_chunks = after["c2w_chunks"] - before["c2w_chunks"]
    busy = {k: round(after["busy"][k] - before["busy"].get(k, 0), 3) for k in after["busy"]}
    steps = {k: after["steps"][k] - before["steps"].get(k, 0) for k in after["steps"]}
    busy_ms = {k: round(1e3 * busy[k] / max(1, steps.get(k, 1)), 2) for k in busy}
    res = {"concurrency": c, "wall_s": round(wall, 3), "audio_s_total": round(audio, 2),
           "audio_s_per_s": round(audio / wall, 3), "arrivals_over_s": stagger_s}
    for key in ("ttft", "ttfa", "e2e", "client_ttfa"):
        xs = [r[key] for r in rows if r[key] is not None]
        if xs:
            res[key] = {"p50": round(statistics.median(xs), 4), "max": round(max(xs), 4),
                        "min": round(min(xs), 4)}
    rtf = [r["e2e"] / r["audio_s"] for r in rows if r["audio_s"]]
    res["rtf"] = {"p50": round(statistics.median(rtf), 4), "max": round(max(rtf), 4),
                  "p90": round(pct(rtf, 0.9), 4)}
    res["per_request_audio_s"] = round(rows[0]["audio_s"], 3)
    res["per_request_text_tokens"] = rows[0]["text_tokens"]
    res["per_request_codes"] = rows[0]["codes"]
    res["audio_chunks_per_request"] = rows[0]["chunks"]
    # the pacing of the audio: chunk k's arrival (median over the requests that got k chunks)
    most = max(len(r["chunk_at"]) for r in rows)
    res["chunk_arrival_s_p50"] = [
        round(statistics.median(r["chunk_at"][k] for r in rows if len(r["chunk_at"]) > k), 3)
        for k in range(most)]
    res["stage_busy_s"] = busy
    res["stage_steps"] = steps
    res["stage_ms_per_step"] = busy_ms
    res["loop_busy_fraction"] = round(sum(busy.values()) / wall, 3)
    res["code2wav_batch_mean"] = round(c2w_chunks / max(1, steps.get("code2wav", 1)), 2)
    res["code2wav_alone_steps"] = after["c2w_alone"] - before["c2w_alone"]
    res["ttfa_parts"] = ttfa_parts(rows)
    calls = HOST_CALLS[n_calls:]
    res["slow_calls"] = [[round(a - t0, 3), round(b, 3), w] for a, b, w in calls
                         if b > SLOW_CALL_S]
    first_audio = min((r["t_submit"] + r["client_ttfa"] for r in rows
                       if r["client_ttfa"] is not None), default=t0 + wall)
    res["host_calls"] = {"round": host_call_totals(calls),
                         "before_first_audio": host_call_totals(
                             [c for c in calls if c[0] < first_audio])}
    res["dynamo_frames_compiled"] = dynamo_frames() - compiles_before
    res["triton_compiles"] = [[round(t - t0, 3), what] for t, what in TRITON_COMPILES[n_triton:]]
    res["graphs_new"] = {k: v - graphs_before.get(k, 0) for k, v in stage_graphs(llm).items()
                         if v != graphs_before.get(k, 0)}
    # [launch at (s), launch host ms, collected at (s), first chunks, later chunks, kind] per
    # code2wav launch of the round
    res["code2wav_steps"] = [[round(a - t0, 3), round(1e3 * (b - a), 1), round(c - t0, 3), *rest]
                             for a, b, c, *rest in C2W_TRACE[n_trace:]]
    return res


async def repeated_round(llm: AsyncOmniLLM, c: int, repeats: int, text_tokens: int,
                         codes: int, seed: int, profile_host: bool = False) -> dict:
    """run_round `repeats` times (one after another): the round with the median RTF, with the
    medians of every round's p50s and each repeat's TTFA and RTF listed."""
    runs = [await run_round(llm, c, text_tokens, codes, seed + 7919 * i, profile_host=profile_host)
            for i in range(repeats)]
    if repeats == 1:
        return runs[0]
    runs.sort(key=lambda r: r["rtf"]["p50"])
    res = dict(runs[len(runs) // 2])
    for key in ("ttft", "ttfa", "e2e", "client_ttfa", "rtf"):
        if all(key in r for r in runs):
            merged = dict(res[key], p50=round(statistics.median(r[key]["p50"] for r in runs), 4),
                          max=max(r[key]["max"] for r in runs))
            if "min" in merged:
                merged["min"] = min(r[key]["min"] for r in runs)
            res[key] = merged
    res["audio_s_per_s"] = round(statistics.median(r["audio_s_per_s"] for r in runs), 3)
    res["repeats"] = repeats
    res["ttfa_p50_each"] = [r["ttfa"]["p50"] for r in runs if "ttfa" in r]
    res["rtf_p50_each"] = [r["rtf"]["p50"] for r in runs]
    return res


def profile_code2wav(res: dict, small: bool, dev: torch.device) -> None:
    """One streaming chunk's cost, split into DiT ODE (sample_mels) and BigVGAN (vocode), at
    batch 1 and 16, with the top ops of one chunk by CUDA and CPU time."""
    from omnistage.models.qwen2_5_omni.code2wav_stream import (
        GUIDANCE_SCALE, ODE_STEPS, SWAY_COEFFICIENT, Qwen2_5OmniCode2WavStream, decode_chunks)
    from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav
    from omnistage.testing.tiny_omni import build_tiny_tokenizer
    cfg = (small_config(build_tiny_tokenizer()) if small else real_config()).to_dict()
    cfg = cfg["token2wav_config"]
    with torch.device(dev):
        model = Qwen2_5OmniToken2Wav(cfg).float().eval()
    spec = model.spec
    g = torch.Generator().manual_seed(0)
    streams = []
    for i in range(16):
        st = Qwen2_5OmniCode2WavStream(model, torch.randn(spec.enc_emb_dim, device=dev),
                                       torch.randn(300, spec.mel_dim, device=dev), i)
        st.add_codes(torch.randint(0, 8000, (1024,), generator=g).tolist(), finished=True)
        streams.append(st)

    def clock(t: float | None = None) -> float:
        sync_dev(dev)
        now = time.perf_counter()
        return now if t is None else round(1e3 * (now - t), 1)

    out: dict = {}
    with torch.inference_mode():
        for _ in range(2):
            decode_chunks(model, [(streams[0], 40)])
        for B in (1, 16):
            reqs = [(s, 40) for s in streams[:B]]
            spans = [s.span(k) for s, k in reqs]
            t = clock()
            decode_chunks(model, reqs)
            chunk_ms, t = clock(t), clock()
            mels = model.sample_mels([s.window_inputs(k) for s, k in reqs], ODE_STEPS,
                                     GUIDANCE_SCALE, SWAY_COEFFICIENT)
            dit_ms, t = clock(t), clock()
            model.vocode([m[sp.vocoder[0] - sp.window[0]:sp.vocoder[1] - sp.window[0]].T
                          for m, sp in zip(mels, spans)])
            out[f"bs{B}"] = {"chunk_ms": chunk_ms, "dit_ode_ms": dit_ms,
                             "bigvgan_ms": clock(t),
                             "window_frames": spans[0].window[1] - spans[0].window[0]}
        t = clock()
        decode_chunks(model, [(streams[0], 0)])
        out["bs1"]["chunk0_ms"] = clock(t)
        if dev.type == "cuda":
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                decode_chunks(model, [(streams[0], 40)])
                sync_dev(dev)
            ev = prof.key_averages()
            out["kernel_launches"] = sum(e.count for e in ev if e.key == "cudaLaunchKernel")
            out["cuda_total_ms"] = round(sum(e.self_device_time_total for e in ev) / 1e3, 1)
            out["top_by_cuda"] = [(e.key[:60], e.count, round(e.self_device_time_total / 1e3, 1))
                                  for e in sorted(ev, key=lambda e: -e.self_device_time_total)
                                  [:10]]
            out["top_by_cpu"] = [(e.key[:60], e.count, round(e.self_cpu_time_total / 1e3, 1))
                                 for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:10]]
    res["code2wav_chunk_profile"] = out


def same_weights_ratios(runs: dict, hf_jsons: list[str]) -> dict:
    """Our rounds against `qwen2_5_omni_gpu.py --hf-only` results (transformers on the very same
    weights; concurrency n = one generate call at batch n): speedups per concurrency in both."""
    hf: dict = {}
    for path in hf_jsons:
        hf.update(json.loads(Path(path).read_text()).get("hf", {}))
    out = {}
    for name, h in sorted(hf.items()):
        ours = runs.get(name)
        if not isinstance(ours, dict) or "audio_s_per_s" not in h:
            continue
        out[name] = {"audio_s_per_s": round(ours["audio_s_per_s"] / h["audio_s_per_s"], 1),
                     "rtf": round(h["rtf_per_request"] / ours["rtf"]["p50"], 1),
                     "ttfa": round(h["ttfa_s"] / ours["ttfa"]["p50"], 1),
                     "hf_audio_s_per_s": h["audio_s_per_s"]}
    return out


class NvmlPeak:
    """The device's peak memory in use as NVML reports it (nvidia-smi polled every 50 ms on a
    thread): the context and workspaces included, unlike the caching allocator's peak."""

    def __init__(self) -> None:
        import subprocess
        import threading
        self.peak = 0
        # the physical GPU this process's cuda:0 is (nvidia-smi ignores CUDA_VISIBLE_DEVICES)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        index = visible if visible.isdigit() else "0"
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
             "-lms", "50", "-i", index], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            if line.strip().isdigit():
                self.peak = max(self.peak, int(line) * 2**20)  # MiB


def sync_dev(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


async def main_async(args, res: dict, save) -> None:
    dev = torch.device(args.device or ("cpu" if args.small else "cuda"))
    profile_host = {n for n in args.profile_host.split(",") if n}
    ckpt = Path(args.ckpt)
    nvml = None  # the whole device as NVML counts it: from the pipeline's load on (below)
    t0 = time.perf_counter()
    if args.profile_code2wav:
        profile_code2wav(res, args.small, dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        save()
    res["checkpoint"] = build_checkpoint(ckpt, args.small, dev)
    save()
    if dev.type == "cuda":  # after the build, which holds the fp32 model on the device
        torch.cuda.empty_cache()
        nvml = NvmlPeak()
    conc = [int(c) for c in args.concurrency.split(",")]
    t1 = time.perf_counter()
    from omnistage.models.qwen2_5_omni.code2wav_options import Qwen2_5OmniCode2WavOptions
    from omnistage.models.qwen2_5_omni.code2wav_stream import Qwen2_5OmniCode2WavStreamConfig
    # None: the engine's defaults (CUDA: a 1-block first chunk, then 24-block chunks)
    window = Qwen2_5OmniCode2WavOptions().stream_config(dev)
    if args.chunk_blocks is not None or args.first_chunk_blocks is not None:
        window = Qwen2_5OmniCode2WavStreamConfig(
            chunk_blocks=args.chunk_blocks or window.chunk_blocks,
            first_chunk_blocks=args.first_chunk_blocks)
    res["code2wav_chunk_blocks"] = window.chunk_blocks
    res["code2wav_first_chunk_blocks"] = window.first_blocks
    options = Qwen2_5OmniCode2WavOptions(dit_dtype=args.code2wav_dtype,
                                         vocoder_dtype=args.code2wav_vocoder_dtype)
    res["code2wav_dit_dtype"] = options.dit_dtype_for(dev)
    res["code2wav_vocoder_dtype"] = options.vocoder_dtype_for(dev)
    per_stage: dict[str, dict] = {}
    for name in filter(None, args.process_stages.split(",")):  # stages in processes of their own
        per_stage.setdefault(name, {})["worker"] = "process"
    for name, devs in parse_stage_devices(args.stage_devices).items():  # e.g. one per GPU
        per_stage.setdefault(name, {})["devices"] = devs
    pipeline = None
    if per_stage:
        pipeline = pipeline_yaml("qwen2_5_omni", ckpt / "pipeline_bench.yaml", per_stage)
        res["process_stages"] = args.process_stages or None
        res["stage_devices"] = args.stage_devices or None
    # sized for the largest round of any kind (a staggered or serial round included)
    top = max(conc + [int(c) for a in [args.oneshot, *(getattr(args, f) for f in ROUND_MODES)]
                      for c in a.split(",") if c]
              + ([args.staggered_c] if args.staggered_modes else []))
    trace_triton_builds()  # (the load's compiles and cache loads)
    llm = AsyncOmniLLM(model=str(ckpt), device=dev.type, max_model_len=2048, pipeline=pipeline,
                       max_num_seqs=top, max_num_batched_tokens=max(2048, 64 * top),
                       code2wav_window=window, code2wav_dit_dtype=args.code2wav_dtype,
                       code2wav_vocoder_dtype=args.code2wav_vocoder_dtype,
                       code2wav_free_sms=args.code2wav_free_sms,
                       code2wav_warmup_plan=args.code2wav_warmup_plan,
                       **({"graph_warmup_plan": args.graph_warmup_plan}
                          if args.graph_warmup_plan else {}),
                       **({"quantization": args.quantization} if args.quantization else {}),
                       **({"gpu_memory_budget": args.gpu_memory_budget}
                          if args.gpu_memory_budget else {}))
    res["load_s"] = round(time.perf_counter() - t1, 1)
    res["startup_phases_s"] = {k: round(v, 2) for k, v in llm.startup_seconds.items()}
    res["pending_captures_after_load"] = pending_captures(llm)
    # what the load compiled and captured (dynamo frames: one per compile, recompiles too)
    res["dynamo_frames_at_load"] = dynamo_frames()
    res["code2wav_graphs_at_load"] = stage_graphs(llm)
    # the Triton kernels the load compiled in this process, and those it loaded compiled
    res["triton_builds_at_load"] = triton_build_counts()
    res["quantization"], res["gpu_memory_budget_GiB"] = args.quantization, args.gpu_memory_budget
    c2w = llm.pipeline.workers.get("code2wav")
    if getattr(getattr(c2w, "model", None), "_decoder", None) is not None:
        res["code2wav_free_sms"] = c2w.model.decoder.free_sms
    trace_code2wav(llm)
    trace_host_calls(llm)
    trace_triton_compiles()
    if dev.type == "cuda":
        res["mem_after_load_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        res["kv_blocks"] = {n: e.runner.num_blocks for n, e in llm.pipeline.engines.items()}
    save()
    t2 = time.perf_counter()
    stage = llm.pipeline.workers.get("code2wav")  # (a stage process warms up at start)
    if args.code2wav_warmup and hasattr(stage, "warmup"):  # capture code2wav's graphs up front
        stage.warmup()
        res["code2wav_warmup_s"] = round(time.perf_counter() - t2, 1)
    # "none": the measured rounds start right after load (the first request after start)
    warm = ([] if args.warmup == "none" else
            [int(c) for c in args.warmup.split(",")] if args.warmup else conc)
    # enough codes for chunk 0, a full window (chunk 1) and a short last chunk (its window
    # pads to the smallest width): the DiT widths the measured rounds use
    warm_codes = min(args.codes, 12 * (window.first_blocks + window.chunk_blocks
                                       + window.future_blocks) + 24)
    res["warmup_codes"] = warm_codes
    for c in warm:  # warm-up: torch.compile, Triton, graph capture per batch size
        await run_round(llm, c, 8, warm_codes, seed=1000 + c)
    if args.warmup_staggered:  # batches that mix prefills, decodes and sampling states
        await run_round(llm, args.warmup_staggered, 8, warm_codes, seed=999,
                        stagger_s=args.stagger_window_s / 2)
    res["warmup_s"] = round(time.perf_counter() - t2, 1)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    res["runs"] = {}
    rounds = [(c, False) for c in conc]
    if args.oneshot_c1:  # right after c1: one-shot code2wav (whole utterance at the end)
        rounds.insert(conc.index(1) + 1 if 1 in conc else 0, (1, True))
    rounds += [(int(c), True) for c in args.oneshot.split(",") if c]
    if args.oneshot_only:
        rounds = [r for r in rounds if r[1]]
    rounds += [(int(c), mode) for flag, (mode, _) in ROUND_MODES.items()
               for c in getattr(args, flag).split(",") if c]
    for m in (m for m in args.staggered_modes.split(",") if m):
        if m not in STAGGERED_MODES:
            raise SystemExit(f"--staggered-modes: {m!r} is not one of {sorted(STAGGERED_MODES)}")
        rounds.append((args.staggered_c, f"staggered_{m}"))
    res["overlap"] = llm.runtime.overlap
    for i, (c, mode) in enumerate(rounds):
        oneshot = mode is True
        staggered = mode == "staggered" or str(mode).startswith("staggered_")
        policy = str(mode).removeprefix("staggered_") if staggered else None
        # code2wav's first-chunk policy for the round (None: the stage's own)
        alone = False if mode == "first_shared" else STAGGERED_MODES.get(policy, {}).get(
            "first_alone")
        name = f"c{c}" + ("_oneshot_code2wav" if oneshot else "") + (
            "_staggered" if staggered else MODE_SUFFIX.get(mode, "")) + (
            f"_{policy}" if policy in STAGGERED_MODES else "")
        if name in res["runs"]:  # a concurrency listed twice: its rounds keep apart
            name += f"_{sum(k.startswith(name) for k in res['runs']) + 1}"
        if i > 0 and time.perf_counter() - t0 > args.deadline_s:
            res["runs"][name] = "skipped: out of time"
            continue
        stage = llm.pipeline.workers.get("code2wav")
        if oneshot and stage is None:
            res["runs"][name] = "skipped: code2wav runs in its own process"
            continue
        window = stage.model.stream_config if stage is not None else None
        if oneshot:
            stage.model.stream_config = None  # read at submit and step: benchmark-side switch
        overlap = llm.runtime.overlap
        if mode == "serial":  # the loop reads it each pass; nothing is in flight between rounds
            llm.runtime.overlap = False
        engines = [w.engine for w in llm.pipeline.workers.values() if hasattr(w, "engine")]
        async_on = [e.async_scheduling for e in engines]
        for e in engines:  # read at each launch; no step is queued between rounds
            e.async_scheduling = e.async_scheduling and mode != "sync"
        first_alone = getattr(stage, "first_alone", None)
        if stage is not None and alone is not None:  # read at each launch
            stage.first_alone = alone
        ar_workers = [w for w in llm.pipeline.workers.values() if hasattr(w, "engine")]
        ar_streams = [w.gpu for w in ar_workers]
        prefill_graphs = [w.engine.runner.prefill_graphs for w in ar_workers]
        pg_runs = [pg.num_runs if pg is not None else 0 for pg in prefill_graphs]
        launcher = getattr(stage, "launcher", None)
        if mode == "c2w_inline" and stage is not None:  # read at each launch
            stage.launcher = None
        if mode == "eager_prefill":  # read at each launch
            for w in ar_workers:
                w.engine.runner.prefill_graphs = None
        if mode in ("ar_shared", "ar_flat"):  # other AR streams (nothing in flight now)
            shared = StageStream(ar_workers[0].device, priority=-1)
            for w in ar_workers:
                w.gpu = shared if mode == "ar_shared" else StageStream(w.device, priority=-1)
        settle = await settle_captures(llm) if 0 <= args.settle_from <= i else None
        pending = pending_captures(llm)
        try:
            if staggered:
                res["runs"][name] = await run_round(
                    llm, c, args.text_tokens, args.codes, seed=c,
                    stagger_s=args.stagger_window_s, profile_host=name in profile_host)
            else:
                res["runs"][name] = await repeated_round(
                    llm, c, args.c1_repeats if c == 1 else 1, args.text_tokens, args.codes,
                    seed=c, profile_host=name in profile_host)
        finally:
            llm.runtime.overlap = overlap
            for e, on in zip(engines, async_on):
                e.async_scheduling = on
            if stage is not None:
                stage.model.stream_config = window
                stage.first_alone = first_alone
                stage.launcher = launcher
            for w, gpu, pg in zip(ar_workers, ar_streams, prefill_graphs):
                w.gpu, w.engine.runner.prefill_graphs = gpu, pg
        if isinstance(res["runs"].get(name), dict):  # lazy warm-up: graphs still to capture
            res["runs"][name]["pending_captures_at_start"] = pending
            res["runs"][name]["pending_captures_at_end"] = pending_captures(llm)
            if settle is not None:
                res["runs"][name]["settle_s"] = settle
        if isinstance(res["runs"].get(name), dict):  # one-sequence prefills run as graphs
            res["runs"][name]["prefill_graph_runs"] = {
                w.name: (pg.num_runs if pg is not None else 0) - n0
                for w, pg, n0 in zip(ar_workers, prefill_graphs, pg_runs)}
        if dev.type == "cuda":
            res["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            res["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
            if nvml is not None:
                res["nvml_peak_used_GiB"] = round(nvml.peak / 2**30, 2)
        save(name)
    llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--ckpt", default="/tmp/omni7b_random")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--text-tokens", type=int, default=128)
    ap.add_argument("--codes", type=int, default=1024)
    ap.add_argument("--deadline-s", type=float, default=420.0,
                    help="start no further round after this many seconds")
    ap.add_argument("--oneshot-c1", action="store_true")
    ap.add_argument("--oneshot", default="", help="concurrencies also run with one-shot code2wav")
    ap.add_argument("--warmup", default="",
                    help="warm-up concurrencies (default: --concurrency; none: no warm-up)")
    ap.add_argument("--settle-from", type=int, default=-1, metavar="K",
                    help="measured rounds from index K on first wait until a lazy warm-up's "
                         "graphs are all captured (the wait is reported as settle_s)")
    ap.add_argument("--oneshot-only", action="store_true", help="skip the streaming rounds")
    ap.add_argument("--serial", default="",
                    help="concurrencies also run with the stages stepped one after another "
                         "(no GPU overlap), after the other rounds")
    ap.add_argument("--sync-sched", default="",
                    help="concurrencies also run without async scheduling in the AR stages "
                         "(each decode step launched after the previous one's tokens are read)")
    ap.add_argument("--staggered", default="",
                    help="concurrencies also run with arrivals spread evenly over "
                         "--stagger-window-s")
    ap.add_argument("--stagger-window-s", type=float, default=6.0)
    ap.add_argument("--warmup-staggered", type=int, default=0,
                    help="also a warm-up round of this many requests arriving over half the "
                         "stagger window (Triton specializes kernels on what mixed batches "
                         "bring: H100, 4 JIT compiles in a staggered round after all-at-once "
                         "warm-ups, each holding the orchestrator 0.5-1.1 s)")
    ap.add_argument("--first-shared", default="",
                    help="concurrencies also run with first audio chunks sharing the GPU with "
                         "the AR stages (code2wav_first_alone=False for that round)")
    ap.add_argument("--ar-streams-shared", default="",
                    help="concurrencies also run with the thinker and talker on one CUDA stream "
                         "(as the engine option ar_stream=NAME; by default each has its own)")
    ap.add_argument("--ar-streams-flat", default="",
                    help="concurrencies also run with the thinker's and talker's streams at one "
                         "priority (by default the thinker's is higher)")
    ap.add_argument("--eager-prefill", default="",
                    help="concurrencies also run with the AR stages' prefills eager (no prefill "
                         "CUDA graphs, as the engine option prefill_graphs=False)")
    ap.add_argument("--code2wav-inline", default="",
                    help="concurrencies also run with code2wav's launches on the orchestrator "
                         "thread (no launcher thread)")
    ap.add_argument("--staggered-modes", default="",
                    help="staggered rounds at --staggered-c, one per listed code2wav policy "
                         f"({', '.join(STAGGERED_MODES)}), in this order")
    ap.add_argument("--staggered-c", type=int, default=32)
    ap.add_argument("--c1-repeats", type=int, default=3,
                    help="concurrency-1 rounds run this many times (medians reported)")
    ap.add_argument("--profile-code2wav", action="store_true")
    ap.add_argument("--chunk-blocks", type=int, default=None,
                    help="DiT blocks per audio chunk (default: the engine's, 24 on CUDA)")
    ap.add_argument("--first-chunk-blocks", type=int, default=None,
                    help="DiT blocks of the first audio chunk (default: --chunk-blocks)")
    ap.add_argument("--code2wav-dtype", default=None, choices=["float32", "tf32", "bfloat16"],
                    help="compute dtype of the streaming code2wav DiT (default: the engine's, "
                         "bfloat16 on CUDA)")
    ap.add_argument("--code2wav-vocoder-dtype", default=None,
                    choices=["float32", "float16", "bfloat16"],
                    help="dtype of BigVGAN's convs (default: the engine's, float16 on CUDA)")
    ap.add_argument("--code2wav-free-sms", type=int, default=None,
                    help="SMs that later-chunk DiT steps leave to the AR stages beside them "
                         "(a CUDA green context; default: the pipeline's, auto)")
    ap.add_argument("--code2wav-warmup", action="store_true",
                    help="capture every code2wav CUDA graph before the warm-up rounds")
    ap.add_argument("--graph-warmup-plan", default=None, choices=["full", "lazy"],
                    help="the AR stages' decode graphs: every batch size at load (full) or "
                         "sizes <= 4 and the largest, the rest in idle passes (lazy); default: "
                         "the engine's (full)")
    ap.add_argument("--code2wav-warmup-plan", default=None, choices=["full", "lazy"],
                    help="code2wav graphs at load: all (full) or a first request's and the "
                         "largest bucket's, the rest in idle gaps (lazy); default: "
                         "the engine's (full)")
    ap.add_argument("--process-stages", default="",
                    help="comma-separated stages to run in processes of their own")
    ap.add_argument("--device", default=None, help="default: cpu with --small, else cuda")
    ap.add_argument("--stage-devices", default="",
                    help='stages on GPUs of their own, e.g. "thinker=cuda:0,talker=cuda:1,'
                         'code2wav=cuda:1" (benchmarks.common.parse_stage_devices)')
    ap.add_argument("--watchdog-s", type=float, default=0,
                    help="print every thread's stack after this many seconds (hang hunting)")
    ap.add_argument("--hf-json", default="",
                    help="comma-separated qwen2_5_omni_gpu.py --hf-only JSONs (the same weights): "
                         "adds vs_hf_same_weights")
    ap.add_argument("--profile-host", default="",
                    help="rounds (by name: c64, c32_staggered, ...) whose orchestrator-thread "
                         "host calls are cProfiled (top functions on stderr)")
    ap.add_argument("--round-timeout-s", type=float, default=240.0,
                    help="a round taking longer dumps every thread's stack and stops")
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--gpu-memory-budget", type=float, default=None, metavar="GIB")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ROUND_TIMEOUT_S["seconds"] = args.round_timeout_s
    if args.watchdog_s:
        faulthandler.dump_traceback_later(args.watchdog_s, repeat=True, exit=False)
    res: dict = {"device": (torch.cuda.get_device_name() if (args.device or "cuda") != "cpu"
                            and not (args.small and args.device is None) else "cpu"),
                 "torch": torch.__version__, "dtype": "bfloat16 (code2wav float32)",
                 "workload": f"~60-id text prompt -> {args.text_tokens} text tokens + "
                             f"{args.codes} codes per request, all submitted at once",
                 "cuda_graphs": "auto (the engines' default)",
                 "hf_h100": HF_H100, "targets": TARGETS}

    def save(key: str | None = None) -> None:
        part = res["runs"].get(key) if key else {k: v for k, v in res.items() if k != "runs"}
        print(f"[{time.strftime('%H:%M:%S')}] {key or 'setup'}: {json.dumps(part)}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")

    # omnistage's warnings, and what the kernels compiled ahead did (listed, found compiled,
    # compiled, failed or not done), in the run's log
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("omnistage.engine.kernels_ahead").setLevel(logging.INFO)
    asyncio.run(main_async(args, res, save))
    c1, c32 = res["runs"].get("c1"), res["runs"].get("c32")
    if isinstance(c1, dict):
        res["vs_hf"] = {"rtf_c1_speedup": round(HF_H100["bs1_rtf"] / c1["rtf"]["p50"], 1),
                        "first_audio_speedup": round(HF_H100["bs1_first_audio_s"]
                                                     / c1["ttfa"]["p50"], 1)}
    if isinstance(res["runs"].get("c8"), dict):
        res.setdefault("vs_hf", {})["audio_s_per_s_c8_speedup"] = round(
            res["runs"]["c8"]["audio_s_per_s"] / HF_H100["bs8_audio_s_per_s"], 1)
    if isinstance(c32, dict):
        res.setdefault("vs_hf", {})["audio_s_per_s_c32_speedup"] = round(
            c32["audio_s_per_s"] / HF_H100["bs32_audio_s_per_s"], 1)
    if args.hf_json:
        res["vs_hf_same_weights"] = same_weights_ratios(res["runs"], args.hf_json.split(","))
    save()
    print(json.dumps(res, indent=1), flush=True)


if __name__ == "__main__":
    main()
