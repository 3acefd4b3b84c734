"""The `omnistage` command: serve (OpenAI-compatible server), generate (one request from the
shell), demo (everything on an embedded tiny model, no download), bench (latency and
throughput of a running server)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from importlib import resources
from pathlib import Path

from omnistage.config import env
from omnistage.entrypoints import bench
from omnistage.sampling_params import SamplingParams

EMBEDDED_MODEL_NAME = "tiny-qwen2.5-omni"  # the default embedded model
# omnistage/assets/question.wav: `espeak-ng -v en-us -s 150` of this text, 16 kHz mono PCM16
DEMO_QUESTION = "What is the capital of France?"
DEMO_ASSET = "question.wav"


def embedded_tiny_omni() -> Path:
    """The embedded tiny random Qwen2.5-Omni, built once (seconds) into the cache directory
    (config.env.cache_dir())."""
    from omnistage.testing.tiny_omni import build_tiny_omni
    return build_tiny_omni(env.cache_dir() / "tiny-qwen2_5-omni")


def embedded_tiny_qwen3_omni() -> Path:
    """The embedded tiny random Qwen3-Omni (MoE thinker and talker, 16-codebook code2wav)."""
    from omnistage.testing.tiny_qwen3_omni import build_tiny_qwen3_omni
    return build_tiny_qwen3_omni(env.cache_dir() / "tiny-qwen3-omni")


# embedded tiny random models by name: `demo --model NAME`, `serve NAME`
# name -> (family, builder, the real checkpoint, talker codes per second of audio)
EMBEDDED_MODELS = {
    "tiny-qwen2.5-omni": ("Qwen2.5-Omni", embedded_tiny_omni, "Qwen/Qwen2.5-Omni-7B", 50.0),
    "tiny-qwen3-omni": ("Qwen3-Omni", embedded_tiny_qwen3_omni,
                        "Qwen/Qwen3-Omni-30B-A3B-Instruct", 12.5)}


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline", default=None, help="pipeline YAML (default: the built-in one)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if present)")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, "
                   "bfloat16, float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per AR stage")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: weight-only e4m3 for the LM's projections (Qwen2.5-Omni's thinker, "
                   "plain LMs) or the MoE experts (Qwen3-Omni)")
    p.add_argument("--gpu-memory-budget", type=float, default=None, metavar="GIB",
                   help="device memory the pipeline may use, as NVML counts it; sizes the KV "
                   "caches (omni pipelines, stages in this process)")
    p.add_argument("--warmup-plan", choices=["full", "lazy"], default=None,
                   help="CUDA graphs at load: full = every graph (default); lazy = those a "
                   "first request and a burst at the largest batch need, the others while the "
                   "server is idle (a faster start; smaller batches run padded until then)")
    p.add_argument("--stage-worker", choices=["inprocess", "process"], default=None,
                   help="run every stage in this process or each in its own (default: the "
                   "pipeline YAML's `worker` keys)")


def _engine_kwargs(args) -> dict:
    opts = {k: getattr(args, k) for k in ("max_model_len", "max_num_seqs",
                                          "max_num_batched_tokens", "num_kv_blocks",
                                          "block_size", "stage_worker", "quantization",
                                          "gpu_memory_budget", "warmup_plan")}
    return {"pipeline": args.pipeline, "device": args.device, "dtype": args.dtype,
            **{k: v for k, v in opts.items() if v is not None}}


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _params(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed)


def _write_wav(path: str, audio, sample_rate: int) -> None:
    import soundfile
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(path, audio, sample_rate, subtype="PCM_16")


# ---------------------------------------------------------------------------------- generate
def cmd_generate(args) -> int:
    from omnistage import OmniLLM
    media = [("audio", p) for p in args.audio] + [("image", p) for p in args.image] + \
        [("video", p) for p in args.video]
    if args.prompt is None and not media:
        print("error: give --prompt and/or --audio / --image / --video", file=sys.stderr)
        return 2
    for _, p in media:
        if not Path(p).is_file():
            print(f"error: no such file: {p}", file=sys.stderr)
            return 2
    llm = OmniLLM(args.model, **_engine_kwargs(args))
    if media:
        parts = [{"type": kind, kind: p} for kind, p in media]
        parts += [{"type": "text", "text": args.prompt}] if args.prompt else []
        prompt = {"messages": [{"role": "user", "content": parts}]}
    elif args.chat or args.output_audio:
        prompt = {"messages": [{"role": "user", "content": args.prompt}]}
    else:
        prompt = args.prompt
    modalities = ["text", "audio"] if args.output_audio else ["text"]
    if args.voice and isinstance(prompt, dict):
        prompt["voice"] = args.voice
    out = llm.generate(prompt, _params(args), output_modalities=modalities, use_tqdm=False)[0]
    llm.shutdown()
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    print(out.text)
    if args.output_audio:
        _write_wav(args.output_audio, out.audio, out.sample_rate)
        print(f"wrote {args.output_audio} ({len(out.audio) / out.sample_rate:.2f} s)",
              file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------- demo
def cmd_demo(args) -> int:
    from omnistage import OmniLLM
    t0 = time.perf_counter()
    family, build, real, codes_per_second = EMBEDDED_MODELS[args.model]
    path = build()
    t_build = time.perf_counter() - t0
    llm = OmniLLM(str(path), device=args.device)
    t_load = time.perf_counter() - t0 - t_build
    question = (resources.files("omnistage") / "assets" / DEMO_ASSET).read_bytes()
    prompt = {"messages": [{"role": "user", "content": [{"type": "audio", "audio": question}]}]}
    t1 = time.perf_counter()
    # a random talker rarely ends on its own: its reply is capped at --max-audio-seconds
    talker = llm.stage_names[1]
    params = {llm.stage_names[0]: SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                 seed=args.seed),
              talker: dataclasses.replace(llm.pipeline.default_params[talker],
                                          max_tokens=int(args.max_audio_seconds
                                                         * codes_per_second))}
    out = llm.generate(prompt, params, output_modalities=["text", "audio"], use_tqdm=False)[0]
    wall = time.perf_counter() - t1
    stats = llm.runtime.stats()
    llm.shutdown()
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    _write_wav(args.output, out.audio, out.sample_rate)
    seconds = len(out.audio) / out.sample_rate
    m = out.metrics
    print(f"model: the embedded tiny random {family} at {path} (built/reused in "
          f"{t_build:.2f} s, loaded in {t_load:.2f} s, device {llm.device})")
    print(f"asked (spoken, {DEMO_ASSET}): {DEMO_QUESTION!r}")
    print(f"reply text: {out.text!r}")
    print(f"reply audio: {args.output} ({seconds:.2f} s at {out.sample_rate} Hz)")
    print(f"timings: first text token {m.ttft or 0:.3f} s, first audio {m.ttfa or 0:.3f} s, "
          f"total {m.e2e or 0:.3f} s (wall {wall:.3f} s)")
    print(f"  {'stage':<10}{'tokens':>8}{'busy s':>10}")
    for stage in llm.stage_names:
        print(f"  {stage:<10}{m.tokens_per_stage.get(stage, 0):>8}"
              f"{stats[stage].get('busy_seconds', 0.0):>10.3f}")
    print("NOTE: this model has random weights, so its text is gibberish and it speaks noise; "
          "the point is the whole pipeline (audio in -> thinker -> talker -> code2wav -> WAV) "
          "running on your machine. For real answers point omnistage at a real checkpoint:\n"
          f"  omnistage generate {real} --audio question.wav --output-audio "
          f"reply.wav\n  omnistage serve {real}   (OpenAI-compatible server; "
          "see docs/quickstart.md)")
    return 0


# ---------------------------------------------------------------------------------- serve
def _ray_address(value: str) -> str:
    """--ray-address: 'auto' or HOST:PORT (checked before anything loads)."""
    from omnistage.runtime.ray_placement import check_ray_address
    try:
        return check_ray_address(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def cmd_serve(args) -> int:
    from omnistage.entrypoints.async_llm import AsyncOmniLLM
    from omnistage.entrypoints.engine_process import LOG_FORMAT
    from omnistage.entrypoints.openai.server import run_server
    from omnistage.entrypoints.openai.serving import ServerConfig

    args.log_level = args.log_level or env.log_level("info")
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    names = args.served_model_name or [args.model or EMBEDDED_MODEL_NAME]
    config = ServerConfig(
        served_model_names=names, api_key=args.api_key or env.api_key(),
        max_queue=args.max_queue, max_request_bytes=int(args.max_request_mb * (1 << 20)),
        allow_remote_media=args.allow_remote_media, allow_local_media=args.allow_local_media,
        max_audio_seconds=args.max_audio_seconds, shutdown_timeout=args.shutdown_timeout,
        switch_interval_ms=args.switch_interval_ms)
    config.validate()  # before any model loading
    model = args.model or EMBEDDED_MODEL_NAME
    if model in EMBEDDED_MODELS:
        family, build, _, _ = EMBEDDED_MODELS[model]
        logging.getLogger("omnistage.server").info(
            "serving the embedded tiny random %s %r (noise, for trying out)", family, model)
        model = str(build())
    ray = {"ray_address": args.ray_address} if args.ray_address else {}
    options = dict(request_timeout=args.request_timeout, prepare_workers=args.prepare_workers,
                   **_engine_kwargs(args), **ray)
    if args.engine_process:
        from omnistage.entrypoints.engine_client import EngineClient
        llm = EngineClient(model, log_level=args.log_level,
                           switch_interval_ms=config.switch_interval_ms, **options)
    else:
        llm = AsyncOmniLLM(model, **options)
    if args.warmup:  # before /health answers: the first request runs as fast as the next
        llm.warmup()
    run_server(llm, config, args.host, args.port, log_level=args.log_level,
               access_log=args.access_log, warmup=args.warmup)
    return 0


# ---------------------------------------------------------------------------------- bench
def cmd_bench(args) -> int:
    return bench.cmd_bench(args, env.api_key())


# ---------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible server (chat, audio speech, metrics)")
    s.add_argument("model", nargs="?", default=None, help="checkpoint directory, hub id, or "
                   f"an embedded tiny model ({', '.join(EMBEDDED_MODELS)}; default "
                   f"{EMBEDDED_MODEL_NAME})")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 "
                   "(default: $OMNISTAGE_API_KEY, else none)")
    s.add_argument("--served-model-name", action="append", default=None,
                   help="model name(s) clients use (default: MODEL as given)")
    s.add_argument("--max-queue", type=int, default=256, help="generation requests in flight; "
                   "more get 429 with Retry-After")
    s.add_argument("--max-request-mb", type=float, default=64.0, help="request body limit")
    s.add_argument("--max-audio-seconds", type=float, default=300.0,
                   help="longest input audio part")
    s.add_argument("--request-timeout", type=float, default=None, help="seconds per request")
    s.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="before serving: one short request through every stage (on every "
                   "preparation thread), then one through the HTTP app")
    s.add_argument("--prepare-workers", type=int, default=4, help="threads that prepare "
                   "requests (tokenising, media decoding) off the event loop")
    s.add_argument("--allow-remote-media", action="store_true",
                   help="fetch http(s) image_url / video_url (off: data URLs only)")
    s.add_argument("--allow-local-media", action="store_true",
                   help="video_url may name a file on the server")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds to let running requests finish")
    s.add_argument("--switch-interval-ms", type=float, default=0.5,
                   help="Python's GIL switch interval while serving (Python's default: 5): "
                   "how long the runtime's thread may wait for the GIL the HTTP loop holds")
    s.add_argument("--log-level", default=None, choices=list(env.LOG_LEVELS),
                   help="default: $OMNISTAGE_LOG_LEVEL, else info")
    s.add_argument("--access-log", action="store_true")
    s.add_argument("--engine-process", action="store_true",
                   help="run the engine (every stage and the runtime loop) in a process of its "
                   "own: HTTP keeps answering (/health says 'dead') if it dies. Off by default: "
                   "on the H200 it gave no speed (c32 TTFT 0.28 against 0.13-0.15 s in one "
                   "process; see docs/structure.md)")
    s.add_argument("--ray-address", type=_ray_address, default=None, metavar="ADDR",
                   help="place the stages as Ray actors on the cluster at ADDR (HOST:PORT of "
                   "its head, or 'auto': the one on this machine); each stage's YAML "
                   "`placement:` picks its node (needs the `ray` extra)")

    g = sub.add_parser("generate", help="one request from the shell")
    g.add_argument("model", help="checkpoint directory or hub id")
    g.add_argument("--prompt", default=None, help="text (with media: the text part)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--audio", action="append", default=[], help="audio file (repeatable)")
    g.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    g.add_argument("--video", action="append", default=[], help="video file (repeatable)")
    g.add_argument("--output-audio", default=None, help="also speak: write the reply as WAV")
    g.add_argument("--voice", default=None, help="speaker (e.g. Chelsie, Ethan)")
    _engine_args(g)
    _sampling_args(g)

    d = sub.add_parser("demo", help="everything on an embedded tiny model, no download")
    d.add_argument("--model", default=EMBEDDED_MODEL_NAME, choices=list(EMBEDDED_MODELS),
                   help="which embedded tiny random model")
    d.add_argument("--device", default="cpu")
    d.add_argument("--output", default="omnistage-demo-reply.wav", help="reply WAV path")
    d.add_argument("--max-tokens", type=int, default=32, help="reply text tokens")
    d.add_argument("--max-audio-seconds", type=float, default=8.0, help="reply audio cap")
    d.add_argument("--seed", type=int, default=0)

    b = sub.add_parser("bench", help="latency and throughput of a running server (TTFT, TTFA, "
                       "RTF, tokens/s, audio-s/s), as vLLM's benchmark_serving",
                       description=bench.__doc__.split("\n\n")[0])
    bench.add_arguments(b)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"serve": cmd_serve, "generate": cmd_generate, "demo": cmd_demo,
                "bench": cmd_bench}[args.command](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
