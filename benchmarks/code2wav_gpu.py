"""Streaming code2wav on the GPU at real Qwen2.5-Omni-7B token2wav shapes (random weights).

Measures one streaming chunk step (DiT ODE: 36 evaluations with CFG batch 2, then BigVGAN) for
  - the module path (`decode_chunks`, eager, the previous implementation; batch 1),
  - `Qwen2_5OmniCode2WavDecoder` with CUDA graphs in bfloat16, with the DiT inductor-compiled
    inside the graphs (`..._compiled_...`) and without, at batch 1, 8 and 32 (one bucket-32
    graph), for the default schedule (1-block chunks, 96-frame windows) and the 1-then-3, 12 and
    24-block schedules (144, 360 and 648-frame windows);
and reports ms per step (and the DiT graph alone), audio seconds per second, first-chunk latency,
first-call (compile + capture) time, graph pool memory, the accuracy of compiled vs uncompiled
and of bf16 vs float32 (mel/waveform max abs, SNR), and a kernel profile of one compiled ODE
(kernels per ODE, GPU time by kind, the attention kernel's name), and `overlap`: whether a
high-priority decode stream (a talker-sized probe) makes progress beside a DiT graph. Prints
one JSON (each section fails alone). `--all` adds the float32/tf32 graph sections and eager
sections (slow). Run from the repo root:
    PYTHONPATH=$PWD python benchmarks/code2wav_gpu.py [--out result.json]
`--small` runs the same code on the CPU with the tiny test config (float32, no graphs): a smoke
test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import sys
import time
import traceback
import types
from pathlib import Path

import torch

try:
    import soundfile  # noqa: F401
except ImportError:  # the GPU machine lacks it; nothing here reads audio files
    sys.modules["soundfile"] = types.ModuleType("soundfile")
    sys.modules["soundfile"].__spec__ = importlib.machinery.ModuleSpec("soundfile", None)

from benchmarks.common import sync, timed  # noqa: E402
from omnistage.models.qwen2_5_omni.code2wav_graphs import Qwen2_5OmniCode2WavDecoder  # noqa: E402
from omnistage.models.qwen2_5_omni.code2wav_stream import (  # noqa: E402
    Qwen2_5OmniCode2WavStream,
    Qwen2_5OmniCode2WavStreamConfig,
    decode_chunks_with_mel,
)
from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav  # noqa: E402

SR, HOP, CODES = 24000, 240, 1024
SCHEDULES = {"default": Qwen2_5OmniCode2WavStreamConfig(),
             "first1_then3": Qwen2_5OmniCode2WavStreamConfig(chunk_blocks=3, first_chunk_blocks=1),
             # the pipeline benchmark's flags: --chunk-blocks 12 --first-chunk-blocks 1
             "first1_then12": Qwen2_5OmniCode2WavStreamConfig(chunk_blocks=12,
                                                              first_chunk_blocks=1),
             # the pipeline's CUDA default since session 8
             "first1_then24": Qwen2_5OmniCode2WavStreamConfig(chunk_blocks=24,
                                                              first_chunk_blocks=1)}
# a middle chunk of each schedule: full window, full vocoder span (window 96, 144, 360, 648)
MIDDLE_CHUNK = {"default": 40, "first1_then3": 14, "first1_then12": 3, "first1_then24": 2}


def token2wav_config(small: bool) -> dict:
    from transformers import Qwen2_5OmniConfig
    if small:
        from omnistage.testing.tiny_omni import build_tiny_config, build_tiny_tokenizer
        cfg = build_tiny_config(build_tiny_tokenizer()).to_dict()["token2wav_config"]
        cfg["dit_config"]["num_embeds"] = 8448
        return cfg
    cfg = Qwen2_5OmniConfig(token2wav_config=dict(dit_config=dict(num_embeds=8448)))
    return cfg.to_dict()["token2wav_config"]


def snr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    err = (x.float() - ref.float()).pow(2).sum()
    return round(float(10 * torch.log10(ref.float().pow(2).sum() / err.clamp(min=1e-30))), 1)


class Bench:
    def __init__(self, args) -> None:
        self.args, self.t0 = args, time.perf_counter()
        self.small = args.small
        dev = torch.device("cpu" if self.small else "cuda")
        self.dev = dev
        self.res: dict = {"device": "cpu" if self.small else torch.cuda.get_device_name(),
                          "torch": torch.__version__, "sections_failed": []}
        torch.manual_seed(0)
        with torch.device(dev):
            self.model = Qwen2_5OmniToken2Wav(token2wav_config(self.small)).float().eval()
        spec = self.model.spec
        self.res["params_M"] = {
            n: round(sum(p.numel() for p in getattr(self.model, n).parameters()) / 1e6, 1)
            for n in ("code2wav_dit_model", "code2wav_bigvgan_model")}
        g = torch.Generator().manual_seed(0)
        self.voices = [(torch.randn(spec.enc_emb_dim, generator=g).to(dev),
                        torch.randn(300, spec.mel_dim, generator=g).to(dev)) for _ in range(8)]
        self.codes = [torch.randint(0, 8000, (CODES,), generator=g).tolist() for _ in range(32)]
        self.decoders: dict = {}

    def streams(self, n: int, config, offset: int = 0) -> list[Qwen2_5OmniCode2WavStream]:
        out = []
        for i in range(offset, offset + n):
            cond, ref = self.voices[i % len(self.voices)]
            s = Qwen2_5OmniCode2WavStream(self.model, cond, ref, i, config)
            s.add_codes(self.codes[i % len(self.codes)], finished=True)
            out.append(s)
        return out

    def decoder(self, dtype: str, graphs: bool, compile: bool = False,
                attention: str | None = None) -> Qwen2_5OmniCode2WavDecoder:
        """attention: the DiT's ("block" Triton kernel or "sdpa"); None: the decoder's default
        (block on CUDA)."""
        if self.small:  # CPU: float32 without graphs only
            dtype, graphs, compile = "float32", False, False
        key = (dtype, graphs, compile, attention)
        if key not in self.decoders:
            self.decoders[key] = Qwen2_5OmniCode2WavDecoder(
                self.model, dit_dtype=dtype, cuda_graphs=graphs, compile=compile,
                dit_attention=attention)
        return self.decoders[key]

    def section(self, name: str, fn) -> None:
        if time.perf_counter() - self.t0 > self.args.deadline_s:
            self.res[name] = "skipped: out of time"
            return
        t = time.perf_counter()
        if not self.small:
            torch.cuda.reset_peak_memory_stats()
        try:
            out = fn()
            out["section_s"] = round(time.perf_counter() - t, 1)
            if not self.small:
                out["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            self.res[name] = out
        except Exception as exc:  # noqa: BLE001 - one failing section must not lose the others
            self.res[name] = {"error": f"{type(exc).__name__}: {exc}",
                              "trace": traceback.format_exc()[-1500:]}
            self.res["sections_failed"].append(name)
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {name}: {json.dumps(self.res[name])}",
              flush=True)
        if self.args.out:
            Path(self.args.out).write_text(json.dumps(self.res, indent=1) + "\n")

    # ------------------------------------------------------------------ sections
    def module_path(self) -> dict:
        """The previous implementation: decode_chunks_with_mel (eager, launch-bound)."""
        out = {}
        for bs in (1, 8) if self.args.all else (1,):
            reqs = [(s, 40) for s in self.streams(bs, SCHEDULES["default"])]
            ms = timed(lambda r=reqs: decode_chunks_with_mel(self.model, r), 2 if bs == 1 else 1)
            out[f"bs{bs}_ms"] = ms
            out[f"bs{bs}_audio_s_per_s"] = round(bs * 24 * HOP / SR / (ms / 1e3), 2)
        return out

    def launches(self, fn) -> dict:
        from torch.profiler import ProfilerActivity, profile
        fn()
        acts = [ProfilerActivity.CPU] + ([] if self.small else [ProfilerActivity.CUDA])
        with profile(activities=acts) as prof:
            fn()
            sync()
        ev = {e.key: e.count for e in prof.key_averages()}
        keys = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch")
        return {k: ev[k] for k in keys if k in ev} or {"aten_ops": sum(
            n for k, n in ev.items() if k.startswith("aten::"))}

    def steps(self, dtype: str, graphs: bool, schedule: str, batches=(1, 8, 32),
              compile: bool = False, attention: str | None = None) -> dict:
        config, dec = SCHEDULES[schedule], self.decoder(dtype, graphs, compile, attention)
        reps = 1 if self.small else 10
        batches = (1, 2) if self.small else batches
        chunk = config.chunk_blocks * self.model.spec.block_size
        k = MIDDLE_CHUNK[schedule]
        out: dict = {}
        for bs in batches:
            reqs = [(s, k) for s in self.streams(bs, config)]
            t = time.perf_counter()
            dec.decode(reqs)  # first call: compiles and captures the graphs of this shape
            sync()
            out[f"bs{bs}_first_call_s"] = round(time.perf_counter() - t, 2)
            ms = timed(lambda r=reqs: dec.decode(r), reps if bs == 1 else max(1, reps // 2))
            out[f"bs{bs}_ms"] = ms
            out[f"bs{bs}_audio_s_per_s"] = round(bs * chunk * HOP / SR / (ms / 1e3), 2)
            out[f"bs{bs}_rtf"] = round((ms / 1e3) / (chunk * HOP / SR), 4)
            if dec.use_graphs:  # the DiT graph alone (the rest: BigVGAN + host work)
                (_, bucket, width), = dec.plan([w1 - w0 for w0, w1 in (
                    s.span(j).window for s, j in reqs)], config)
                out[f"bs{bs}_dit_ms"] = timed(dec.dit_graphs[(bucket, width)].replay, reps)
        # first-chunk latency: chunk 0 of a new stream (speaker encoder + noise draw included)
        fresh = iter(range(100, 200))
        dec.decode([(self.streams(1, config, next(fresh))[0], 0)])  # capture chunk 0's shapes
        firsts = []
        for _ in range(min(5, reps)):
            s = self.streams(1, config, next(fresh))[0]
            sync()
            t = time.perf_counter()
            dec.decode([(s, 0)])
            sync()
            firsts.append(1e3 * (time.perf_counter() - t))
        out["first_chunk_ms"] = round(sorted(firsts)[len(firsts) // 2], 2)
        out["launches_bs1"] = self.launches(
            lambda: dec.decode([(self.streams(1, config)[0], k)]))
        out["graphs"] = dec.stats()
        out["graph_MiB"] = {f"{kind}_b{b}_w{w}": round(n / 2**20, 1)
                            for (kind, b, w), n in dec.graphs.graph_bytes.items()}
        return out

    def accuracy(self) -> dict:
        """bf16 compiled vs uncompiled graphs; fp32/bf16 graphs (compiled or not, block or SDPA
        attention) vs fp32 eager with SDPA (the module's math); fast eager vs the module path."""
        config = SCHEDULES["default"]
        reqs = [(s, k) for s, k in zip(self.streams(8, config), (0, 1, 2, 40, 41, 60, 84, 85))]
        # chunks 0-1 clipped at frame 0, 85 (the last: 8 frames) at the utterance's end
        ref = self.decoder("float32", False, attention="sdpa").decode(reqs)
        out: dict = {}
        module = decode_chunks_with_mel(self.model, reqs[:2])
        out["fast_eager_vs_module_max_abs"] = {
            "mel": float(max((a.mel - b.mel).abs().max() for a, b in zip(ref, module))),
            "wave": float(max((a.waveform - b.waveform).abs().max() for a, b in zip(ref, module)))}
        # (dtype, graphs, compiled, attention); None: the default (block on CUDA)
        variants = [("float32", False, False, "block"), ("float32", True, False, None),
                    ("bfloat16", True, False, None), ("bfloat16", True, True, None),
                    ("bfloat16", True, True, "sdpa")]
        if self.args.all:
            variants.append(("tf32", True, False, None))
        got = {}
        for dtype, graphs, comp, attention in variants:
            name = (f"{dtype}{'_compiled' if comp else ''}{'_graph' if graphs else '_eager'}"
                    f"{'_sdpa' if attention == 'sdpa' else ''}")
            got[name] = self.decoder(dtype, graphs, comp, attention).decode(reqs)
            out[f"{name}_vs_fp32_eager_sdpa"] = compare(got[name], ref)
        if "bfloat16_compiled_graph" in got:
            out["bfloat16_compiled_vs_uncompiled"] = compare(got["bfloat16_compiled_graph"],
                                                             got["bfloat16_graph"])
        mel_ref = torch.cat([c.mel for c in ref], 1)
        wav_ref = torch.cat([c.waveform for c in ref])
        out["ref_mel_rms"] = round(float(mel_ref.pow(2).mean().sqrt()), 3)
        out["ref_wave_rms"] = round(float(wav_ref.pow(2).mean().sqrt()), 4)
        out["ref_wave_clipped_frac"] = round(float((wav_ref.abs() > 0.999).float().mean()), 4)
        # the streaming approximation itself, for scale: default windows vs one-shot generate
        n = 120
        s = self.streams(1, config)[0]
        codes = torch.tensor(s.codes[:n], device=self.dev)
        noise = Qwen2_5OmniToken2Wav.initial_noise(s.seed, 2 * n).to(self.dev)
        mels, wavs = self.model.generate([codes], [s.cond], [s.ref_mel], [noise])
        short = Qwen2_5OmniCode2WavStream(self.model, s.cond, s.ref_mel, s.seed, config)
        short.add_codes(s.codes[:n], finished=True)
        chunks = self.decoder("float32", False).decode(
            [(short, k) for k in range(short.num_chunks())])
        out["streaming_vs_oneshot_fp32"] = {
            "mel_snr_db": snr_db(torch.cat([c.mel for c in chunks], 1), mels[0]),
            "wave_snr_db": snr_db(torch.cat([c.waveform for c in chunks]), wavs[0])}
        return out

    def attention_op(self) -> dict:
        """The DiT's block-attention kernel alone at the real heads (16 x 64), batch-32 CFG rows
        (64), windows of 144 and 360 frames, per tile config; against torch's path (rotary
        through cat, SDPA over the dense additive mask, the output transpose) and SDPA alone."""
        import torch.nn.functional as F

        from omnistage.models.qwen2_5_omni import dit_attention_triton as dat
        from omnistage.models.qwen2_5_omni.code2wav_fast import _rope_head
        from omnistage.models.qwen2_5_omni.token2wav_dit import qwen2_5_omni_dit_attention_mask
        spec, out = self.model.spec, {}
        heads, hd = spec.num_attention_heads, spec.head_dim
        rows = 2 if self.small else 64
        configs = [(64, 64, 4, 2)] if self.small else [
            (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 2, 2), (32, 64, 4, 2),
            (128, 64, 8, 2), (128, 32, 4, 2), (64, 64, 8, 2), (32, 32, 4, 1)]
        g = torch.Generator().manual_seed(0)
        dt = torch.float32 if self.small else torch.bfloat16
        for w in (144, 360):
            qkv = torch.randn(rows, w, 3 * heads * hd, generator=g).to(self.dev, dt)
            start = (torch.randint(0, 40, (rows,), generator=g) * spec.block_size).to(self.dev)
            nvalid = torch.full((rows,), w, device=self.dev)
            pos = start[:, None] + torch.arange(w, device=self.dev)
            angles = pos[:, None, :, None].float() * self.model.code2wav_dit_model.inv_freq
            cos, sin = angles.cos().to(dt), angles.sin().to(dt)
            nbytes = qkv.numel() * qkv.element_size() * 4 / 3  # q, k, v read; out written
            for look in ((0, 0), (1, 0)):
                allowed = qwen2_5_omni_dit_attention_mask(pos, nvalid[:, None] > 0, spec.block_size,
                                                          *look)
                mask = torch.zeros(allowed.shape, device=self.dev, dtype=dt).masked_fill_(
                    ~allowed, float("-inf"))
                frames = dat.frame_table(start, nvalid, *look)

                t = qkv.view(rows, w, 3, heads, hd).permute(2, 0, 3, 1, 4)  # q, k, v views

                def torch_path(mask=mask, t=t, w=w, cos=cos, sin=sin):
                    qk = torch.cat([_rope_head(t[:2, :, :1], cos, sin), t[:2, :, 1:]], dim=2)
                    att = F.scaled_dot_product_attention(qk[0], qk[1], t[2], attn_mask=mask)
                    return att.transpose(1, 2).reshape(rows, w, -1)

                res = {"torch_path_ms": timed(torch_path, 20),
                       "sdpa_alone_ms": timed(lambda m=mask, t=t: F.scaled_dot_product_attention(
                           t[0], t[1], t[2], attn_mask=m), 20)}
                ref = torch_path()
                for bm, bn, nw, ns in configs:
                    def run(f=frames, bm=bm, bn=bn, nw=nw, ns=ns, qkv=qkv, cos=cos, sin=sin):
                        return dat.launch(qkv, cos[:, 0], sin[:, 0], f, heads, spec.block_size,
                                          bm, bn, nw, ns)
                    try:
                        ms = timed(run, 20)
                    except Exception as exc:  # noqa: BLE001 - a config that does not build
                        res[f"m{bm}n{bn}w{nw}s{ns}"] = f"{type(exc).__name__}: {str(exc)[:100]}"
                        continue
                    res[f"m{bm}n{bn}w{nw}s{ns}"] = {
                        "ms": ms, "GBps": round(nbytes / ms / 1e6, 1),
                        "max_abs_vs_torch": round(float((run() - ref).abs().max()), 4)}
                out[f"w{w}_lb{look[0]}la{look[1]}"] = res
        return out

    def kernels(self, attention: str | None = None) -> dict:
        """One compiled bf16 ODE run eagerly (no graph) under the profiler: kernels per ODE, GPU
        time by kind, the attention kernels' names; at (bucket 1, 96), (bucket 32, 144) and
        (bucket 32, 360: the pipeline's 12-block chunks)."""
        from torch.profiler import ProfilerActivity, profile
        dec = self.decoder("bfloat16", not self.small, not self.small, attention)
        out: dict = {}
        shapes = ((1, 96), (32, 144), (32, 360)) if not self.small else ((1, 96),)
        for bucket, width in shapes:
            buf = dec.new_dit_inputs(bucket, width)
            buf["nvalid"].fill_(width)
            with torch.inference_mode():
                run = lambda b=buf: dec._dit(b, dec.compile)  # noqa: E731
                run()
                sync()
                acts = [ProfilerActivity.CPU] + ([] if self.small else [ProfilerActivity.CUDA])
                with profile(activities=acts) as prof:
                    run()
                    sync()
            kinds: dict = {}
            n, attn = 0, set()
            for e in prof.key_averages():
                if self.small or e.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                name = e.key.lower()
                kind = ("attention" if any(w in name for w in ("fmha", "attention", "flash"))
                        else "gemm" if any(w in name for w in ("gemm", "nvjet", "sm90", "cutlass",
                                                               "cublas"))
                        else "triton" if name.startswith("triton") else "other")
                us = getattr(e, "self_device_time_total", None) or e.self_cuda_time_total
                kinds[kind] = kinds.get(kind, 0.0) + us / 1e3
                n += e.count
                if kind == "attention":
                    attn.add(e.key[:120])
            out[f"b{bucket}_w{width}"] = {
                "kernels_per_ode": n, "gpu_ms_by_kind": {k: round(v, 2) for k, v in kinds.items()},
                "gpu_ms": round(sum(kinds.values()), 2), "attention_kernels": sorted(attn)}
        return out


    def overlap(self) -> dict:
        """Does the DiT's graph starve a high-priority decode stream beside it (the pipeline's
        talker)? A probe graph of talker-sized bf16 GEMMs at batch 32 (24 layers: qkv, o,
        gate/up, SiLU-mul, down; ~2.6 GB of weights) replays on a priority -2 stream, at most
        2 steps queued (as an AR engine runs), while a thread launches the batch-32 360-frame
        DiT ODE on a priority-0 stream (the decoder's graphs: one per RK4 interval, back to
        back; session 8 measured one whole-ODE graph the same way). Reports the DiT's GPU time,
        the probe steps done meanwhile, how long the launches held their threads, and
        overlap_gain = (DiT alone + those probe steps alone) / the DiT's time beside them
        (> 1: running them together beats running them in turn)."""
        import threading

        import torch.nn.functional as F

        from omnistage.engine.streams import private_stream
        if self.small:
            return {"skipped": "CUDA graphs and streams: GPU only"}
        dec = self.decoder("bfloat16", True, True)
        bucket, width = 32, 360
        g = dec.dit_graph(bucket, width)
        g.inputs["nvalid"].fill_(width)
        d, ff, dev = 896, 18944, self.dev
        gen = torch.Generator(device=dev).manual_seed(0)
        ws = [tuple(torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
                    for n, k in ((2560, d), (d, 1536), (2 * ff, d), (d, ff))) for _ in range(24)]
        x = torch.randn(bucket, d, device=dev, dtype=torch.bfloat16)

        def probe_step() -> torch.Tensor:
            h = x
            for wqkv, wo, wgu, wd in ws:
                qkv = F.linear(h, wqkv)
                h = h + F.linear(qkv[:, :1536], wo)
                gu = F.linear(h, wgu)
                h = h + F.linear(F.silu(gu[:, :ff]) * gu[:, ff:], wd)
            return h

        probe, _ = dec.graphs.capture(probe_step, ("probe", bucket, d))
        hi, lo = private_stream(dev, -2), private_stream(dev, 0)
        out: dict = {}
        with torch.cuda.stream(hi):
            out["probe_alone_ms"] = timed(probe.replay, 20)
        with torch.cuda.stream(lo):
            out["dit_alone_ms"] = timed(g.replay, 3)
        # (a DiT on fewer SMs beside the probe: benchmarks/green_context_gpu.py; a graph keeps
        # the SMs of the context it was captured in, so replaying this one elsewhere would not)

        def launch_dit(marks: dict) -> None:
            with torch.cuda.stream(lo):
                marks["start"].record()
                t = time.perf_counter()
                g.replay()
                marks["launch_ms"] = 1e3 * (time.perf_counter() - t)
                marks["end"].record()
            marks["recorded"].set()

        for _ in range(2):  # the second run is the one reported (the first warms)
            sync()
            marks = {"start": torch.cuda.Event(enable_timing=True),
                     "end": torch.cuda.Event(enable_timing=True), "recorded": threading.Event()}
            base = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(hi):
                base.record()
            thread = threading.Thread(target=launch_dit, args=(marks,))
            thread.start()
            ends, host_ms = [], []
            while len(ends) < 3000:
                if marks["recorded"].is_set() and marks["end"].query():
                    break
                if len(ends) >= 2:
                    ends[-2].synchronize()
                t = time.perf_counter()
                with torch.cuda.stream(hi):
                    probe.replay()
                    ends.append(torch.cuda.Event(enable_timing=True))
                    ends[-1].record()
                host_ms.append(1e3 * (time.perf_counter() - t))
            thread.join()
            sync()
        t0 = base.elapsed_time(marks["start"])
        t1 = base.elapsed_time(marks["end"])
        during = [e for e in ends if t0 <= base.elapsed_time(e) <= t1]
        dit_ms = t1 - t0
        out["interval_graphs"] = {
            "dit_ms": round(dit_ms, 1), "dit_launch_host_ms": round(marks["launch_ms"], 1),
            "probe_steps_during_dit": len(during),
            "probe_ms_per_step_during_dit": round(dit_ms / max(1, len(during)), 2),
            "probe_launch_host_ms_max": round(max(host_ms), 2),
            "probe_launch_host_ms_p50": round(sorted(host_ms)[len(host_ms) // 2], 3),
            "overlap_gain": round((out["dit_alone_ms"] + len(during) * out["probe_alone_ms"])
                                  / dit_ms, 3)}
        return out


def compare(got: list, ref: list) -> dict:
    mel_ref, wav_ref = torch.cat([c.mel for c in ref], 1), torch.cat([c.waveform for c in ref])
    mel, wav = torch.cat([c.mel for c in got], 1), torch.cat([c.waveform for c in got])
    return {"mel_max_abs": float((mel - mel_ref).abs().max()),
            "wave_max_abs": float((wav - wav_ref).abs().max()),
            "mel_snr_db": snr_db(mel, mel_ref), "wave_snr_db": snr_db(wav, wav_ref),
            "wave_snr_db_worst_chunk": min(snr_db(a.waveform, b.waveform)
                                           for a, b in zip(got, ref))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--small", action="store_true", help="CPU smoke test on the tiny config")
    ap.add_argument("--all", action="store_true",
                    help="also the float32/tf32 graph and eager sections (slow)")
    ap.add_argument("--deadline-s", type=float, default=220.0,
                    help="start no further section after this many seconds")
    ap.add_argument("--sections", default=None,
                    help="comma-separated section names to run (default: all of the run)")
    args = ap.parse_args()
    if not args.small and not torch.cuda.is_available():
        raise SystemExit("code2wav_gpu.py: needs a CUDA device")
    b = Bench(args)
    sections = [("module_path_fp32", b.module_path), ("accuracy", b.accuracy)]
    for schedule in SCHEDULES:
        sections.append((f"graph_bfloat16_compiled_{schedule}",
                         lambda s=schedule: b.steps("bfloat16", True, s, compile=True)))
    # the same with the DiT's attention on SDPA over dense masks (before the block kernel)
    sections.append(("graph_bfloat16_compiled_first1_then12_sdpa",
                     lambda: b.steps("bfloat16", True, "first1_then12", compile=True,
                                     attention="sdpa")))
    sections += [("attention_op", b.attention_op), ("kernels_bfloat16_compiled", b.kernels),
                 ("kernels_bfloat16_compiled_sdpa", lambda: b.kernels("sdpa")),
                 ("overlap", b.overlap)]
    for schedule in ("default", "first1_then3"):  # the uncompiled graphs, for comparison
        sections.append((f"graph_bfloat16_{schedule}",
                         lambda s=schedule: b.steps("bfloat16", True, s)))
    if args.all:
        sections.append(("fast_eager_fp32", lambda: b.steps("float32", False, "default", (1,))))
        for dtype in ("float32", "tf32"):
            sections.append((f"graph_{dtype}_default",
                             lambda d=dtype: b.steps(d, True, "default")))
        sections.append(("graph_float32_first1_then3",
                         lambda: b.steps("float32", True, "first1_then3")))
    wanted = set(args.sections.split(",")) if args.sections else None
    unknown = (wanted or set()) - {name for name, _ in sections}
    if unknown:
        raise SystemExit(f"--sections: unknown {sorted(unknown)}; known: "
                         f"{[name for name, _ in sections]}")
    for name, fn in sections:
        if wanted is None or name in wanted:
            b.section(name, fn)
    b.res["total_s"] = round(time.perf_counter() - b.t0, 1)
    b.res["peak_mem_GiB_max_section"] = max(
        (v["peak_mem_GiB"] for v in b.res.values() if isinstance(v, dict) and "peak_mem_GiB" in v),
        default=None)
    if args.out:
        Path(args.out).write_text(json.dumps(b.res, indent=1) + "\n")
    print(json.dumps(b.res, indent=1), flush=True)


if __name__ == "__main__":
    main()
