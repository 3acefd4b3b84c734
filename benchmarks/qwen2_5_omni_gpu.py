"""Qwen2.5-Omni stages on the GPU at real 7B shapes with random weights (as
/work/shared/reference/hf_baseline_gpu.py measures transformers): thinker ms/token (CUDA graphs
and eager), TTFT, talker ms/code, code2wav seconds, and the stage-sum e2e / RTF of a text
prompt -> 128 text tokens + 1024 codes. Models are built directly on the device in bf16 (no
checkpoint on disk). `--tiny` runs the same code on the tiny reference config (CPU smoke test).

NOTE: e2e here is the sum of the stages run one after another (thinker, then talker, then
code2wav), an upper bound for the pipeline, which overlaps thinker and talker steps. TTFA is
e2e for now (code2wav decodes the whole utterance)."""

from __future__ import annotations

import argparse
import importlib.machinery
import dataclasses
import json
import os
import sys
import time
import types

import torch

try:
    import soundfile  # noqa: F401
except ImportError:  # the GPU machine lacks it; nothing here reads audio files
    sys.modules["soundfile"] = types.ModuleType("soundfile")
    sys.modules["soundfile"].__spec__ = importlib.machinery.ModuleSpec("soundfile", None)

from omnistage.engine.ar.engine import AREngine  # noqa: E402
from omnistage.engine.ar.scheduler import EngineConfig  # noqa: E402
from omnistage.engine.ar.sequence import Sequence  # noqa: E402
from omnistage.models.qwen2_5_omni.talker import ALWAYS_READY, Qwen2_5OmniTalkerForCausalLM
from omnistage.models.qwen2_5_omni.thinker import Qwen2_5OmniThinkerForCausalLM  # noqa: E402
from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav  # noqa: E402
from omnistage.sampling_params import SamplingParams  # noqa: E402

IM_S, IM_E = 151644, 151645


def omni_config(tiny: bool) -> dict:
    if tiny:
        with open("/tmp/tiny_omni_ref/config.json") as f:
            return json.load(f)
    from transformers import Qwen2_5OmniConfig
    return Qwen2_5OmniConfig(
        thinker_config=dict(vision_start_token_id=151652, vision_end_token_id=151653),
        talker_config=dict(vision_start_token_id=151652, hidden_size=896, num_hidden_layers=24,
                           num_attention_heads=12, num_key_value_heads=4, head_dim=128,
                           intermediate_size=18944, embedding_size=3584, vocab_size=8448),
        token2wav_config=dict(dit_config=dict(num_embeds=8448))).to_dict()


def prompt_ids(vocab: int, tiny: bool) -> list[int]:
    g = torch.Generator().manual_seed(1)
    if tiny:
        return torch.randint(20, vocab - 1, (50,), generator=g).tolist()
    body = torch.randint(1000, 100000, (48,), generator=g).tolist()
    return ([IM_S, 8948, 198] + body[:8] + [IM_E, 198, IM_S, 872, 198] + body[8:]
            + [IM_E, 198, IM_S, 77091, 198])


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def build(cls, cfg: dict, dev: torch.device, dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random init straight in the target dtype
    try:
        with torch.device(dev):
            return cls(cfg).eval()
    finally:
        torch.set_default_dtype(old)


class RandomRows:
    """Stands in for the thinker -> talker adapter: random rows, prompt rows replace."""

    def __init__(self, prompt_len: int, width: int, dev, dtype) -> None:
        self.table = torch.randn(4096, width, device=dev, dtype=dtype) * 0.02
        self.prompt_len = prompt_len

    def ready(self, seq) -> int:
        return ALWAYS_READY

    def rows(self, seq, start, end):
        replace = torch.arange(start, end, device=self.table.device) < self.prompt_len
        return self.table[start:end], replace


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
                     input_source=RandomRows(prompt_len, width, dev, dtype), cacheable=False)
            for i in range(B)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--text-tokens", type=int, default=128)
    ap.add_argument("--codes", type=int, default=1024)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-audio", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    TN, TK = args.text_tokens, args.codes
    torch.manual_seed(0)
    cfg = omni_config(args.tiny)
    res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                 "torch": torch.__version__, "dtype": str(dtype), "text_tokens": TN, "codes": TK,
                 "cuda_graphs": os.environ.get("OMNISTAGE_CUDA_GRAPHS", "1") != "0"}

    def report():
        if dev.type == "cuda":
            res["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        print(json.dumps(res), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    t0 = time.perf_counter()
    thinker = build(Qwen2_5OmniThinkerForCausalLM, cfg["thinker_config"], dev, dtype)
    sync(dev)
    res["thinker_build_s"] = round(time.perf_counter() - t0, 1)
    prompt = prompt_ids(thinker.vocab_size, args.tiny)
    ecfg = EngineConfig(max_model_len=2048, max_num_seqs=max(batches),
                        max_num_batched_tokens=4096)
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

    talker = build(Qwen2_5OmniTalkerForCausalLM, cfg["talker_config"], dev, dtype)
    k_eng = AREngine(talker, dataclasses.replace(ecfg, max_num_seqs=max(batches)), dev, dtype)
    with torch.device(dev):
        t2w = Qwen2_5OmniToken2Wav(cfg["token2wav_config"]).float().eval()
    spec = t2w.spec
    cond = torch.randn(1, spec.enc_emb_dim, device=dev)
    ref_mel = torch.randn(1, 300, spec.mel_dim, device=dev)
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


if __name__ == "__main__":
    main()
