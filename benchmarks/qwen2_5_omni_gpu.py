"""Qwen2.5-Omni stages on the GPU at real 7B shapes with random weights (as
/work/shared/reference/hf_baseline_gpu.py measures transformers): thinker ms/token (CUDA graphs
and eager), TTFT, talker ms/code, code2wav seconds, and the stage-sum e2e / RTF of a text
prompt -> 128 text tokens + 1024 codes. Models are built directly on the device in bf16 (no
checkpoint on disk). `--tiny` runs the same code on the tiny reference config (CPU smoke test).

`--hf-only` measures transformers instead (benchmarks/hf_omni_gpu.py) on the very same weights:
each stage module is built from its own fixed seed (SEEDS) in both modes, and the HF mode copies
ours into transformers' model. It first checks the thinker's logits (JSON "bf16_logits": ours on
the paged-KV engine vs transformers' forward, teacher-forced), then times one `generate` call
per batch size (concurrency n = batch n; first audio = the end of generate).

NOTE: e2e here is the sum of the stages run one after another (thinker, then talker, then
code2wav), an upper bound for the pipeline, which overlaps thinker and talker steps. TTFA is
e2e for now (code2wav decodes the whole utterance)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.machinery
import json
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # omnistage and benchmarks.*

from omnistage.engine.ar.engine import AREngine  # noqa: E402
from omnistage.engine.ar.scheduler import EngineConfig  # noqa: E402
from omnistage.engine.ar.sequence import Sequence  # noqa: E402
from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav  # noqa: E402
from omnistage.sampling_params import SamplingParams  # noqa: E402
from omnistage.testing.input_rows import RandomInputRows  # noqa: E402

from benchmarks.hf_omni_gpu import SEEDS, build_stage, id_range, omni_config  # noqa: E402

IM_S, IM_E = 151644, 151645
SPEAKER_BOS = {False: 151872, True: 13}  # the talker's text bos (voice) row: 7B, tiny


def prompt_ids(vocab: int, tiny: bool) -> list[int]:
    g = torch.Generator().manual_seed(1)
    if tiny:
        return torch.randint(*id_range(vocab, tiny), (50,), generator=g).tolist()
    body = torch.randint(*id_range(vocab, tiny), (48,), generator=g).tolist()
    return ([IM_S, 8948, 198] + body[:8] + [IM_E, 198, IM_S, 872, 198] + body[8:]
            + [IM_E, 198, IM_S, 77091, 198])


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def speaker_tensors(t2w, dev) -> tuple[torch.Tensor, torch.Tensor]:
    # (cond [1, enc_emb_dim], ref_mel [1, 300, mel_dim]) fp32, the same in both modes
    g = torch.Generator().manual_seed(SEEDS["speaker"])
    spec = t2w.spec
    return (torch.randn(1, spec.enc_emb_dim, generator=g).to(dev),
            torch.randn(1, 300, spec.mel_dim, generator=g).to(dev))


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def run_engine(engine: AREngine, seqs: list[Sequence], dev) -> dict:
    """Steps until done; returns TTFT (s), decode ms per step after the first token, total s."""
    sync(dev)
    t0 = time.perf_counter()
    for s in seqs:
        engine.add_request(s)
    first: dict[str, float] = {}
    steps_after_first = 0
    while engine.has_unfinished():
        updates = engine.step()
        now = time.perf_counter()
        if len(first) == len(seqs):
            steps_after_first += 1
        for u in updates:
            if u.new_token_ids and u.request_id not in first:
                first[u.request_id] = now
    sync(dev)
    end = time.perf_counter()
    t_first = max(first.values())
    return {"ttft_s": round(min(first.values()) - t0, 4), "total_s": round(end - t0, 3),
            "decode_ms_per_step": round(1e3 * (end - t_first) / max(1, steps_after_first), 3),
            "tokens_per_seq": [len(s.output_token_ids) for s in seqs][:1]}


def thinker_seqs(prompt, n, B, tag):
    p = SamplingParams(temperature=0, min_tokens=n, max_tokens=n)
    pos = torch.arange(len(prompt)).expand(3, -1).clone()
    return [Sequence(f"{tag}-{i}", list(prompt), p, seed=i, mrope_positions=pos)
            for i in range(B)]


def talker_seqs(talker, prompt_len, n, B, tag, dev, dtype):
    c = talker.codec_ids
    ids = [c["mask"]] * prompt_len + [c["pad"], c["start"]]
    p = dataclasses.replace(talker.default_params(), min_tokens=n, max_tokens=n)
    width = talker.model.embed_tokens.weight.shape[1]
    return [Sequence(f"{tag}-{i}", ids, p, seed=100 + i,
                     mrope_positions=torch.arange(len(ids)).expand(3, -1).clone(),
                     input_source=RandomInputRows(prompt_len, width, 7, dev, dtype,
                                                                  scale=0.02), cacheable=False)
            for i in range(B)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--text-tokens", type=int, default=128)
    ap.add_argument("--codes", type=int, default=1024)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-audio", action="store_true")
    ap.add_argument("--hf-only", action="store_true", help="measure transformers instead")
    ap.add_argument("--skip-logits", action="store_true", help="HF mode: no logits check")
    ap.add_argument("--logits-only", action="store_true", help="HF mode: only the logits check")
    ap.add_argument("--logit-prompts", type=int, default=4)
    ap.add_argument("--logit-prompt-len", type=int, default=160)
    ap.add_argument("--logit-decode-len", type=int, default=48)
    ap.add_argument("--cuda-graphs", choices=("auto", "off", "eager"), default="auto",
                    help="the AR engines' EngineConfig.cuda_graphs")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    TN, TK = args.text_tokens, args.codes
    torch.manual_seed(0)
    cfg = omni_config(args.tiny)
    res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                 "torch": torch.__version__, "dtype": str(dtype), "text_tokens": TN, "codes": TK,
                 "cuda_graphs": args.cuda_graphs != "off"}

    def report():
        if dev.type == "cuda":
            res["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        print(json.dumps(res), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    prompt = prompt_ids(cfg["thinker_config"]["text_config"]["vocab_size"], args.tiny)
    if args.hf_only:
        run_hf_only(args, cfg, dev, dtype, batches, prompt, res, report)
        return
    t0 = time.perf_counter()
    thinker = build_stage("thinker", cfg, dev, dtype)
    sync(dev)
    res["thinker_build_s"] = round(time.perf_counter() - t0, 1)
    ecfg = EngineConfig(max_model_len=2048, max_num_seqs=max(batches),
                        max_num_batched_tokens=4096, cuda_graphs=args.cuda_graphs)
    t_eng = AREngine(thinker, ecfg, dev, dtype, eos_token_ids={IM_E})
    res["thinker"] = {}
    for B in batches:  # warm-up run per size: Triton compiles and graph capture stay out
        run_engine(t_eng, thinker_seqs(prompt, 4, B, f"w{B}"), dev)
        r = run_engine(t_eng, thinker_seqs(prompt, TN, B, f"t{B}"), dev)
        res["thinker"][f"bs{B}"] = r
        report()
    graphs = t_eng.runner.graphs
    t_eng.runner.graphs = None
    run_engine(t_eng, thinker_seqs(prompt, 4, 1, "we"), dev)
    res["thinker"]["bs1_eager"] = run_engine(t_eng, thinker_seqs(prompt, 32, 1, "te"), dev)
    t_eng.runner.graphs = graphs
    report()
    if args.skip_audio:
        return

    talker = build_stage("talker", cfg, dev, dtype)
    k_eng = AREngine(talker, dataclasses.replace(ecfg, max_num_seqs=max(batches)), dev, dtype)
    t2w = build_stage("token2wav", cfg, dev, dtype)
    cond, ref_mel = speaker_tensors(t2w, dev)
    res["talker"], res["code2wav"], res["pipeline_stage_sum"] = {}, {}, {}
    for B in [b for b in batches if b <= 8]:
        run_engine(k_eng, talker_seqs(talker, len(prompt), 4, B, f"kw{B}", dev, dtype), dev)
        r = run_engine(k_eng, talker_seqs(talker, len(prompt), TK, B, f"k{B}", dev, dtype), dev)
        res["talker"][f"bs{B}"] = r
        gen = torch.Generator().manual_seed(B)
        codes = [torch.randint(0, talker.vocab_size - 4, (TK,), generator=gen).to(dev)
                 for _ in range(B)]
        noises = [Qwen2_5OmniToken2Wav.initial_noise(i, 2 * TK).to(dev) for i in range(B)]
        with torch.inference_mode():
            t2w.generate(codes[:1], [cond], [ref_mel], noises[:1])  # warm-up
            sync(dev)
            t1 = time.perf_counter()
            _, wavs = t2w.generate(codes, [cond] * B, [ref_mel] * B, noises)
            sync(dev)
        c2w_s = time.perf_counter() - t1
        audio_s = sum(w.numel() for w in wavs) / 24000
        res["code2wav"][f"bs{B}"] = {"s": round(c2w_s, 3), "audio_s_total": round(audio_s, 2)}
        th = res["thinker"].get(f"bs{B}")
        if th is not None:
            e2e = th["total_s"] + r["total_s"] + c2w_s
            res["pipeline_stage_sum"][f"c{B}"] = {
                "e2e_s": round(e2e, 3), "ttft_s": th["ttft_s"], "ttfa_s": round(e2e, 3),
                "rtf_per_request": round(e2e / (audio_s / B), 4),
                "rtf_aggregate": round(e2e / audio_s, 4),
                "audio_s_per_s": round(audio_s / e2e, 2)}
        report()


def _copy(copy_into_hf, hf, ours, name: str, res: dict) -> bool:
    # timings do not depend on the values: if names ever stop lining up, time transformers' own
    # random init and say so in the JSON
    try:
        copy_into_hf(getattr(hf, name), ours, name)
        return True
    except ValueError as e:
        res.setdefault("weight_copy_errors", {})[name] = str(e)[:500]
        return False


def run_hf_only(args, cfg: dict, dev, dtype, batches: list[int], prompt: list[int], res: dict,
                report) -> None:
    """transformers on our seeds' weights: the logits check, then one generate per batch size."""
    import transformers

    from benchmarks.hf_omni_gpu import (build_hf_model, copy_into_hf, hf_generate_bench,
                                        hf_warmup, set_speaker, thinker_logit_parity)
    res.update(mode="transformers", transformers=transformers.__version__,
               weights=f"omnistage's seeds {SEEDS} copied into transformers")
    t0 = time.perf_counter()
    hf = build_hf_model(cfg, dev, dtype)
    thinker = build_stage("thinker", cfg, dev, dtype)
    copied = _copy(copy_into_hf, hf, thinker, "thinker", res)
    sync(dev)
    res["build_s"] = round(time.perf_counter() - t0, 1)
    if not args.skip_logits and copied:
        try:
            res["bf16_logits"] = dict(dtype=str(dtype), **thinker_logit_parity(
                thinker, hf.thinker, dev, dtype, id_range(thinker.vocab_size, args.tiny),
                args.logit_prompts, args.logit_prompt_len, args.logit_decode_len))
        except Exception as e:  # keep the timings below
            res["bf16_logits"] = {"error": repr(e)[:500]}
        report()
    del thinker
    free(dev)
    if args.logits_only:
        return
    for name in ("talker", "token2wav"):
        ours = build_stage(name, cfg, dev, dtype)
        _copy(copy_into_hf, hf, ours, name, res)
        if name == "token2wav":
            set_speaker(hf, SPEAKER_BOS[args.tiny], *speaker_tensors(ours, dev))
        del ours
        free(dev)
    hf_warmup(hf, prompt, dev)
    res["hf"] = {}
    for B in batches:
        try:
            res["hf"][f"c{B}"] = hf_generate_bench(hf, prompt, B, args.text_tokens, args.codes, dev,
                                                   text_only=args.skip_audio)
        except Exception as e:  # e.g. out of memory at a large batch: keep the others
            res["hf"][f"c{B}"] = {"error": repr(e)[:500]}
            free(dev)
        report()


if __name__ == "__main__":
    main()
