"""transformers' Qwen2.5-Omni on the same random weights as omnistage's GPU benchmark.

- build_stage: one omnistage stage module (thinker / talker / token2wav) with random weights
  from its own fixed seed (SEEDS), at Qwen2.5-Omni-7B shapes (omni_config) or the tiny config.
- copy_into_hf: our stage modules' weights -> transformers' model (names differ only by the
  thinker's `model.language_model.` / `model.audio_tower.` / `model.visual.` nesting, which
  transformers 5.x adds at load time; older 5.x keep the checkpoint names, also accepted).
- thinker_logit_parity: teacher-forced logits of omnistage's engine (chunked prefill over a paged
  prefix, then decode steps, CUDA graphs where enabled) against transformers' thinker forward
  on the same token sequences.
- hf_generate_bench: concurrency n = one `generate` call at batch n (transformers has no
  continuous batching), text prompt -> fixed text + codec lengths.
Runs on CPU in fp32 with the tiny reference config (`--tiny`) and on CUDA in bf16 at 7B shapes.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import torch

from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.scheduler import EngineConfig
from omnistage.engine.ar.sequence import Sequence
from omnistage.models.qwen2_5_omni.talker import Qwen2_5OmniTalkerForCausalLM
from omnistage.models.qwen2_5_omni.thinker import Qwen2_5OmniThinkerForCausalLM
from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav
from omnistage.sampling_params import SamplingParams

SAMPLE_RATE = 24000
SEEDS = {"thinker": 0, "talker": 1, "token2wav": 2, "speaker": 3}
TINY_REF = "/tmp/tiny_omni_ref/config.json"
# transformers >= 5.x nests the thinker's parts; ours keep the checkpoint's names
_THINKER_NESTING = (("model.language_model.", "model."), ("model.audio_tower.", "audio_tower."),
                    ("model.visual.", "visual."))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------ weights
def omni_config(tiny: bool) -> dict:
    if tiny:
        with open(TINY_REF) as f:
            return json.load(f)
    from transformers import Qwen2_5OmniConfig
    return Qwen2_5OmniConfig(
        thinker_config=dict(vision_start_token_id=151652, vision_end_token_id=151653),
        talker_config=dict(vision_start_token_id=151652, hidden_size=896, num_hidden_layers=24,
                           num_attention_heads=12, num_key_value_heads=4, head_dim=128,
                           intermediate_size=18944, embedding_size=3584, vocab_size=8448),
        token2wav_config=dict(dit_config=dict(num_embeds=8448))).to_dict()


def with_thinker_layers(cfg: dict, layers: int) -> dict:
    """A copy of cfg whose thinker LM has `layers` decoder layers (same widths)."""
    cfg = copy.deepcopy(cfg)
    text = cfg["thinker_config"]["text_config"]
    text["num_hidden_layers"] = layers
    if text.get("layer_types"):  # transformers checks its length against the layer count
        text["layer_types"] = (text["layer_types"] * layers)[:layers]
    return cfg


def id_range(vocab: int, tiny: bool) -> tuple[int, int]:
    return (20, vocab - 1) if tiny else (1000, 100000)


def build(cls, cfg: dict, dev: torch.device, dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random init straight in the target dtype
    try:
        with torch.device(dev):
            return cls(cfg).eval()
    finally:
        torch.set_default_dtype(old)


def build_stage(name: str, cfg: dict, dev: torch.device, dtype: torch.dtype):
    """One stage's module with random weights from its own seed (the same in both modes)."""
    torch.manual_seed(SEEDS[name])
    if name == "token2wav":  # fp32 by design
        with torch.device(dev):
            return Qwen2_5OmniToken2Wav(cfg["token2wav_config"]).float().eval()
    cls = {"thinker": Qwen2_5OmniThinkerForCausalLM, "talker": Qwen2_5OmniTalkerForCausalLM}[name]
    return build(cls, cfg[f"{name}_config"], dev, dtype)


def hf_config(cfg: dict):
    from transformers import Qwen2_5OmniConfig
    return Qwen2_5OmniConfig.from_dict(cfg)


def build_hf_model(cfg: dict, dev: torch.device, dtype: torch.dtype, thinker_only: bool = False):
    """transformers' Qwen2_5OmniForConditionalGeneration (or only its thinker) built on `dev`
    (random init; the weights are then overwritten by copy_into_hf)."""
    from transformers import (Qwen2_5OmniForConditionalGeneration,
                              Qwen2_5OmniThinkerForConditionalGeneration)
    c = hf_config(cfg)
    cls, c = ((Qwen2_5OmniThinkerForConditionalGeneration, c.thinker_config) if thinker_only
              else (Qwen2_5OmniForConditionalGeneration, c))
    with torch.device(dev):
        return cls._from_config(c, dtype=dtype).eval()


def our_name(component: str, hf_name: str) -> str:
    if component == "thinker":
        for hf_prefix, ours in _THINKER_NESTING:
            if hf_name.startswith(hf_prefix):
                return ours + hf_name[len(hf_prefix):]
    return hf_name


@torch.no_grad()
def copy_into_hf(hf_module: torch.nn.Module, ours: torch.nn.Module, component: str) -> int:
    """Overwrite transformers' `component` weights with ours (cast to its dtype); every tensor on
    both sides must be matched. Returns the number of tensors copied."""
    src = ours.state_dict()
    dst = hf_module.state_dict()
    names = {n: our_name(component, n) for n in dst}
    missing = sorted(n for n, o in names.items() if o not in src)
    unused = sorted(set(src) - set(names.values()))
    if missing or unused:
        raise ValueError(f"{component}: weights do not line up: transformers has no source for "
                         f"{missing[:5]} ({len(missing)}), ours unused {unused[:5]} "
                         f"({len(unused)})")
    for n, t in dst.items():
        s = src[names[n]]
        if s.shape != t.shape:
            raise ValueError(f"{component}.{n}: shape {tuple(s.shape)} vs {tuple(t.shape)}")
        t.copy_(s)
    return len(dst)


def set_speaker(hf, bos_token: int, cond: torch.Tensor, ref_mel: torch.Tensor) -> None:
    # cond: [1, enc_emb_dim], ref_mel: [1, L, mel_dim]; the voice generate() uses by default
    t2w_dtype = next(hf.token2wav.parameters()).dtype
    hf.speaker_map = {"Chelsie": {"bos_token": bos_token, "cond": cond.to(t2w_dtype),
                                  "ref_mel": ref_mel.to(t2w_dtype)}}


# ------------------------------------------------------------------------------ logits parity
def _engine_hidden(thinker, prompts: list[list[int]], decode_len: int, dev: torch.device,
                   dtype: torch.dtype, chunk: int) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy-decodes every prompt together on omnistage's engine; per prompt: (the tokens fed,
    final hidden rows [len, D] of each fed position)."""
    longest = max(len(p) for p in prompts) + decode_len
    bs = 16
    per_seq = -(-(longest + bs) // bs)
    ecfg = EngineConfig(max_model_len=longest + bs, max_num_seqs=len(prompts),
                        max_num_batched_tokens=chunk, block_size=bs,
                        num_kv_blocks=len(prompts) * per_seq + 2, enable_prefix_caching=False)
    eng = AREngine(thinker, ecfg, dev, dtype)
    params = SamplingParams(temperature=0, min_tokens=decode_len, max_tokens=decode_len,
                            ignore_eos=True)
    seqs = []
    for i, p in enumerate(prompts):
        seqs.append(Sequence(f"lp{i}", list(p), params, seed=i, export_hidden=True,
                             mrope_positions=torch.arange(len(p)).expand(3, -1).clone()))
        eng.add_request(seqs[-1])
    rows: dict[str, list[tuple[int, torch.Tensor]]] = {s.request_id: [] for s in seqs}
    while eng.has_unfinished():
        for u in eng.step():
            if u.hidden is not None:
                rows[u.request_id].append((u.hidden[0], u.hidden[1].clone()))
    out = []
    for s in seqs:
        parts = sorted(rows[s.request_id], key=lambda r: r[0])
        starts = [r[0] for r in parts]
        sizes = [r[1].shape[0] for r in parts]
        if starts != [sum(sizes[:i]) for i in range(len(sizes))]:
            raise RuntimeError(f"{s.request_id}: hidden rows are not contiguous: {starts}")
        fed = s.prompt_token_ids + s.output_token_ids[:-1]  # the last token is never fed
        hidden = torch.cat([r[1] for r in parts])
        if hidden.shape[0] != len(fed):
            raise RuntimeError(f"{s.request_id}: {hidden.shape[0]} hidden rows, {len(fed)} fed")
        out.append((fed, hidden))
    return out


class _Agreement:
    """Running top-1 agreement and abs-diff stats of ours vs reference logits."""

    def __init__(self) -> None:
        self.n = {"all": 0, "agree": 0, "pre": 0, "agree_pre": 0, "clear": 0, "agree_clear": 0}
        self.max_abs, self.sum_abs, self.n_el, self.std, self.gaps = 0.0, 0.0, 0, [], []

    def add(self, ours: torch.Tensor, ref: torch.Tensor, prompt_len: int) -> None:
        # ours, ref: [L, V] fp32; rows < prompt_len are prefill positions
        diff = (ours - ref).abs()
        self.max_abs = max(self.max_abs, diff.max().item())
        self.sum_abs += diff.sum().item()
        self.n_el += diff.numel()
        self.std.append(ref.std().item())
        top2 = ref.topk(2, dim=-1)
        gap = top2.values[:, 0] - top2.values[:, 1]
        same = ours.argmax(-1) == top2.indices[:, 0]
        # clear: transformers' top-2 gap exceeds the error on those two ids (no rounding tie)
        clear = gap > diff.gather(1, top2.indices).sum(-1)
        for key, v in (("all", same.numel()), ("agree", same.sum()), ("pre", prompt_len),
                       ("agree_pre", same[:prompt_len].sum()), ("clear", clear.sum()),
                       ("agree_clear", (same & clear).sum())):
            self.n[key] += int(v)
        self.gaps += gap[~same].tolist()

    def result(self) -> dict[str, Any]:
        n = self.n
        dec = n["all"] - n["pre"]
        return {"top1_agreement": round(n["agree"] / n["all"], 5),
                "top1_agreement_prefill": round(n["agree_pre"] / n["pre"], 5),
                "top1_agreement_decode": round((n["agree"] - n["agree_pre"]) / max(1, dec), 5),
                "top1_agreement_clear": round(n["agree_clear"] / max(1, n["clear"]), 5),
                "clear_positions": n["clear"], "max_abs_logit_diff": round(self.max_abs, 5),
                "mean_abs_logit_diff": round(self.sum_abs / self.n_el, 6),
                "ref_logit_std": round(sum(self.std) / len(self.std), 4),
                "ref_top2_gap_at_disagreements": [round(x, 5) for x in sorted(self.gaps)[:12]]}


@torch.inference_mode()
def thinker_logit_parity(thinker, hf_thinker, dev: torch.device, dtype: torch.dtype,
                         id_range: tuple[int, int], num_prompts: int = 4, prompt_len: int = 160,
                         decode_len: int = 48, chunk: int = 128, seed: int = 7) -> dict[str, Any]:
    """Teacher-forced thinker logits, ours vs transformers', over num_prompts * (prompt_len +
    decode_len - 1) positions. Prompts are random ids in id_range; the decoded part is our own
    greedy continuation, which transformers then reads as input (teacher forcing).

    NOTE: "native_head" compares the logits as each side computes them (bf16 lm_head). Random
    weights give flat logits whose top two often round to the same bf16 value, so there a flip
    says nothing about the model; "fp32_head" puts both sides' final hidden rows through the
    same lm_head in fp32, which leaves only the differences of the decoder stack."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(*id_range, (prompt_len,), generator=g).tolist()
               for _ in range(num_prompts)]
    t0 = time.perf_counter()
    fed_hidden = _engine_hidden(thinker, prompts, decode_len, dev, dtype, chunk)
    head = thinker.lm_head.weight.float()  # [V, D]
    captured: list[torch.Tensor] = []  # transformers' final hidden rows: the lm_head's input
    hook = hf_thinker.lm_head.register_forward_hook(lambda m, a, out: captured.append(a[0]))
    low, full, self_consistent = _Agreement(), _Agreement(), 0
    try:
        for fed, hidden in fed_hidden:
            ids = torch.tensor([fed], device=dev)
            captured.clear()
            ref = hf_thinker(input_ids=ids, attention_mask=torch.ones_like(ids),
                             use_cache=False).logits[0].float()  # [L, V]
            ours = thinker.compute_logits(hidden).float()  # [L, V]
            if ours.shape != ref.shape or len(captured) != 1:
                raise RuntimeError(f"logits: ours {tuple(ours.shape)} vs transformers "
                                   f"{tuple(ref.shape)}, {len(captured)} lm_head calls")
            low.add(ours, ref, prompt_len)
            full.add(hidden.float() @ head.T, captured[0][0].float() @ head.T, prompt_len)
            # our greedy choices at decode positions = argmax of the exported rows' logits
            outs = torch.tensor(fed[prompt_len:], device=dev)
            self_consistent += int((ours[prompt_len - 1:-1].argmax(-1) == outs).sum())
    finally:
        hook.remove()
    return {"positions": low.n["all"], "prompts": num_prompts, "prompt_len": prompt_len,
            "decode_len": decode_len, "prefill_chunk": chunk,
            "native_head": low.result(), "fp32_head": full.result(),
            "greedy_self_consistency": round(
                self_consistent / max(1, num_prompts * (decode_len - 1)), 5),
            "s": round(time.perf_counter() - t0, 1)}


# ------------------------------------------------------------------------------ generate timings
def _text_generate(hf, ids: torch.Tensor, n: int):
    return hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_mode="text",
                       thinker_max_new_tokens=n, thinker_min_new_tokens=n,
                       thinker_do_sample=False)


def _audio_generate(hf, ids: torch.Tensor, text_tokens: int, codes: int):
    return hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                       thinker_max_new_tokens=text_tokens, thinker_min_new_tokens=text_tokens,
                       thinker_do_sample=False, talker_max_new_tokens=codes,
                       talker_min_new_tokens=codes)


def _timed(dev: torch.device, fn, *args):
    sync(dev)
    t0 = time.perf_counter()
    out = fn(*args)
    sync(dev)
    return out, time.perf_counter() - t0


def hf_warmup(hf, prompt: list[int], dev: torch.device) -> None:
    ids = torch.tensor([prompt], device=dev)
    _text_generate(hf, ids, 4)
    _audio_generate(hf, ids, 2, 8)
    sync(dev)


def hf_generate_bench(hf, prompt: list[int], batch: int, text_tokens: int, codes: int,
                      dev: torch.device, text_only: bool = False) -> dict[str, Any]:
    """One batch of `batch` copies of the prompt: TTFT (a 1-token generate), thinker decode
    ms/token, and the text + audio generate (first audio = its end: transformers returns the
    waveform only when all is done)."""
    ids = torch.tensor([prompt] * batch, device=dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out, t1 = _timed(dev, _text_generate, hf, ids, 1)
    out, tn = _timed(dev, _text_generate, hf, ids, text_tokens)
    new = out.shape[1] - ids.shape[1]
    r: dict[str, Any] = {"ttft_s": round(t1, 4), "text_s": round(tn, 3), "text_tokens": new,
                         "thinker_ms_per_token": round(1e3 * (tn - t1) / max(1, new - 1), 2)}
    if not text_only:
        (seq, wav), e2e = _timed(dev, _audio_generate, hf, ids, text_tokens, codes)
        wavs = list(wav) if isinstance(wav, (list, tuple)) else [wav]
        if batch > 1 and len(wavs) == 1 and wavs[0].dim() == 2:
            wavs = list(wavs[0])
        audio_s = sum(w.numel() for w in wavs) / SAMPLE_RATE
        r.update({"e2e_s": round(e2e, 3), "ttfa_s": round(e2e, 3),
                  "text_tokens_e2e": seq.shape[1] - ids.shape[1],
                  "audio_s_total": round(audio_s, 2),
                  "rtf_per_request": round(e2e / max(1e-9, audio_s / batch), 4),
                  "rtf_aggregate": round(e2e / max(1e-9, audio_s), 4),
                  "audio_s_per_s": round(audio_s / e2e, 3),
                  "requests_per_s": round(batch / e2e, 4)})
    if dev.type == "cuda":
        r["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return r
