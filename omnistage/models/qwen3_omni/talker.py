"""Qwen3-Omni talker on the AR engine: a MoE LM over codec codes whose every step also runs the
code predictor (codebooks 1..K-1 of the frame, inside the engine step), and the thinker ->
talker adapter that feeds it.

NOTE (the handoff, as transformers' generate builds it): the talker's prompt is
  - the user turns of the thinker prompt (system and earlier assistant turns dropped): at
    audio/image/video placeholders the thinker's hidden state of layer `accept_hidden_layer`
    through `hidden_projection`, elsewhere the thinker's token embedding through
    `text_projection`;
  - 9 assistant rows: text_projection(embedding) of `<|im_start|>`, `assistant`, `\\n`; then
    <tts_pad> + codec nothink / think_bos / think_eos / speaker, <tts_bos> + codec pad, and
    the first reply token + codec bos (so the talker starts after the thinker's first token).
Decode step j feeds frame j (codebook 0's embedding + the sum of codebooks 1..K-1's code
predictor embeddings: the engine adds those) plus text row j: the embedding of reply token
j + 1 through text_projection, <tts_eos> in place of the reply's last token, <tts_pad> after.
Reply rows are token embeddings, not hidden states, so a reply token's row exists as soon as
the thinker samples it.

NOTE (prefix cache): a user-turn position's KV is set by its row and position, and both by the
thinker prompt up to that position (a token's embedding; a placeholder's hidden state, which
sees everything before it, system and earlier assistant turns included). So the talker's hash
(talker_prefix_key) takes, per user-turn position, the thinker's id there, the thinker tokens
dropped just before it (a span keyed by their ids and media) and the thinker's media mapped to
talker positions: two talker prompts hash alike as far as the thinker prompts agree up to the
last user position hashed. A later turn's talker prompt begins with the earlier turns' user
rows, so it hits their blocks. From the assistant rows on (voice, reply) a span unique to the
request keeps the blocks private."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.ar.interface import DecoderContract, ForwardBatch, merge_inputs
from omnistage.engine.ar.sampler import SamplerState, SamplingTensors
from omnistage.engine.ar.sequence import MediaSpan, Sequence
from omnistage.layers.moe_decoder import MoEDecoderConfig, MoEDecoderModel, load_named_tensors
from omnistage.models.registry import register_adapter, register_model
from omnistage.runtime.stage import HOST_DATA
from omnistage.sampling_params import SamplingParams

ALWAYS_READY = 1 << 40
NUM_ASSISTANT_ROWS = 9
# the code predictor's draws are keyed apart from codebook 0's (same request seed)
_RESIDUAL_SEED_SALT = 0x5BD1E995
SAMPLER_SLOTS = 256  # rows per inner draw call (larger batches draw in several calls)


@dataclass(frozen=True)
class ResidualSampling:
    """How the code predictor draws codebooks 1..K-1 (transformers' subtalker defaults);
    greedy whenever the talker's own sampling is greedy."""

    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.8


class ResizeMLP(nn.Module):
    """thinker width -> talker width: linear_fc1, SiLU, linear_fc2 (both with bias)."""

    def __init__(self, in_dim: int, mid_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_dim, mid_dim)
        self.linear_fc2 = nn.Linear(mid_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class CodePredictor(nn.Module):
    """Checkpoint names (after `talker.code_predictor.`): model.layers.*, model.norm,
    model.codec_embedding.{i} (codebook i+1's embedding), lm_head.{i} (predicts codebook
    i+1). A fresh context per frame: [talker hidden, codebook-0 embedding, codebooks 1.. as
    drawn], so it runs with a small dense KV cache of its own, not the engine's paged one."""

    def __init__(self, cfg: dict, num_code_groups: int) -> None:
        super().__init__()
        self.config = MoEDecoderConfig.from_hf(dict(cfg, num_experts=0))
        c = self.config
        self.num_residuals = num_code_groups - 1
        self.model = MoEDecoderModel(c, embed_tokens=False)
        self.model.codec_embedding = nn.ModuleList(
            nn.Embedding(c.vocab_size, c.hidden_size) for _ in range(self.num_residuals))
        self.lm_head = nn.ModuleList(nn.Linear(c.hidden_size, c.vocab_size, bias=False)
                                     for _ in range(self.num_residuals))
        self.sampler: SamplerState | None = None

    def _layers(self, x: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [N, t, D] at positions pos..pos+t-1 -> normed hidden [N, t, D]; K/V written to
        the caches [layers, N, max_len, Hkv, hd]; rope: cos/sin of the context's positions."""
        N, t, D = x.shape
        cos, sin = (r[pos:pos + t].repeat(N, 1) for r in rope)
        h = x.reshape(N * t, D)
        for i, layer in enumerate(self.model.layers):
            q, k, v = layer.qkv(h, cos, sin)
            k_cache[i, :, pos:pos + t] = k.reshape(N, t, *k.shape[1:])
            v_cache[i, :, pos:pos + t] = v.reshape(N, t, *v.shape[1:])
            qh = q.reshape(N, t, *q.shape[1:]).transpose(1, 2)  # [N, H, t, hd]
            kh = k_cache[i, :, :pos + t].transpose(1, 2)
            vh = v_cache[i, :, :pos + t].transpose(1, 2)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=t > 1 and pos == 0,
                                               enable_gqa=True)
            h = layer.attn_out_mlp(h, o.transpose(1, 2).reshape(N * t, *q.shape[1:]))
        return self.model.norm(h).reshape(N, t, D)

    def generate(self, hidden: torch.Tensor, first_embed: torch.Tensor,
                 sampling: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, D] (the talker's normed last hidden), first_embed [N, D] (codebook 0's
        embedding) -> (codes [N, K-1] long, the sum of their embeddings [N, D]).
        sampling.step holds each row's base step; inner draw j uses step + j."""
        c = self.config
        N, K1 = hidden.shape[0], self.num_residuals
        cache_shape = (len(self.model.layers), N, K1 + 1, c.num_key_value_heads, c.head_dim)
        k_cache = hidden.new_empty(cache_shape)
        v_cache = hidden.new_empty(cache_shape)
        x = torch.stack([hidden, first_embed.to(hidden.dtype)], dim=1)
        # the context's rotary table once per frame (positions 0..K-1), not once per inner step
        rope = self.model.rotary_emb(torch.arange(K1 + 1, device=hidden.device))
        pos, base_step = 0, sampling.step
        codes, embed_sum = [], torch.zeros_like(hidden)
        for j in range(K1):
            h = self._layers(x, pos, k_cache, v_cache, rope)[:, -1]
            pos += x.shape[1]
            sampling.step = base_step + j
            code = self._sampler(h.device).sample_params(self.lm_head[j](h).float(), sampling)
            codes.append(code)
            emb = self.model.codec_embedding[j](code)
            embed_sum = embed_sum + emb
            x = emb[:, None]
        sampling.step = base_step
        return torch.stack(codes, dim=1), embed_sum

    def _sampler(self, device: torch.device) -> SamplerState:
        """The inner draws' sampler (its rows hold each step's per-row params): the engine's
        sampler, the Triton kernels on CUDA. Made at the first (uncaptured) call."""
        if self.sampler is None or self.sampler.device != device:
            self.sampler = SamplerState(SAMPLER_SLOTS, self.config.vocab_size, device)
        return self.sampler


@register_model("Qwen3OmniMoeTalker")
class Qwen3OmniTalkerForCausalLM(DecoderContract, nn.Module):
    """Checkpoint names (after `talker.`): model.codec_embedding, model.layers.*, model.norm,
    codec_head, text_projection.*, hidden_projection.*, code_predictor.*."""

    def __init__(self, talker_config: dict) -> None:
        super().__init__()
        text = talker_config["text_config"]
        # transformers interleaves the talker's mrope whatever the config flags say
        self.config = MoEDecoderConfig.from_hf(text, mrope_interleaved=True)
        c = self.config
        self.talker_config = talker_config
        self.model = MoEDecoderModel(c, embed_tokens=False)
        self.model.codec_embedding = nn.Embedding(c.vocab_size, c.hidden_size)
        thinker_dim = talker_config["thinker_hidden_size"]
        self.text_projection = ResizeMLP(thinker_dim, text["intermediate_size"], c.hidden_size)
        self.hidden_projection = ResizeMLP(thinker_dim, text["intermediate_size"], c.hidden_size)
        self.codec_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.num_code_groups = talker_config["num_code_groups"]
        self.code_predictor = CodePredictor(talker_config["code_predictor_config"],
                                            self.num_code_groups)
        self.residual_sampling = ResidualSampling()

    # ------------------------------------------ engine contract (the rest: DecoderContract)
    @property
    def input_embedding(self) -> nn.Embedding:
        return self.model.codec_embedding  # the talker's ids are codec codes

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(merge_inputs(self.embed(batch.input_ids), batch), batch)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.codec_head(hidden).float()

    def predict_residuals(self, hidden: torch.Tensor, tokens: torch.Tensor, seeds: torch.Tensor,
                          steps: torch.Tensor, greedy: torch.Tensor, all_greedy: bool
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's multi-codebook hook: codebooks 1..K-1 of the frames whose codebook 0
        (tokens [N]) was just sampled from hidden [N, D] (greedy [N]: that row's talker
        sampling is; all_greedy: every row's, known on the host) -> (codes [N, K-1], their
        summed embeddings [N, D], which the engine adds when the token is fed). Device work
        only, no host sync: the engine captures it in the decode step's CUDA graph."""
        s, N, dev = self.residual_sampling, tokens.shape[0], tokens.device
        temperature = torch.where(greedy, 0.0, s.temperature).float()
        sampling = SamplingTensors(
            temperature=temperature, top_k=torch.full((N,), s.top_k, device=dev),
            top_p=torch.full((N,), s.top_p, device=dev), min_p=torch.zeros(N, device=dev),
            seed=seeds ^ _RESIDUAL_SEED_SALT, step=steps * self.num_code_groups,
            all_greedy=all_greedy or s.temperature == 0,
            any_top_k=s.top_k > 0, any_top_p=s.top_p < 1, any_min_p=False)
        return self.code_predictor.generate(hidden, self.embed(tokens), sampling)

    def load_weights(self, tensors) -> None:
        load_named_tensors(self, tensors)

    # ---------------------------------------------------------------- handoff rows
    def project_prompt(self, user_rows: torch.Tensor, user_mm: torch.Tensor,
                       assistant_embeds: torch.Tensor, specials: torch.Tensor,
                       codec_ids: list[int]) -> torch.Tensor:
        """The talker prompt rows [U + 9, D]: user_rows [U, Dt] (hidden at user_mm, else
        embeddings), assistant_embeds [4, Dt] (`<|im_start|>`, `assistant`, `\\n`, first reply
        token), specials [3, Dt] (tts bos, eos, pad embeddings), codec_ids: nothink,
        think_bos, think_eos, speaker, codec pad, codec bos."""
        dt = self.codec_head.weight.dtype
        rows = torch.empty(user_rows.shape[0], self.config.hidden_size, device=user_rows.device,
                           dtype=dt)
        mm = user_mm.to(user_rows.device)
        if bool(mm.any()):
            rows[mm] = self.hidden_projection(user_rows[mm].to(dt))
        if not bool(mm.all()):
            rows[~mm] = self.text_projection(user_rows[~mm].to(dt))
        text = self.text_projection(assistant_embeds.to(dt))
        tts_bos, _, tts_pad = self.text_projection(specials.to(dt)).unbind(0)
        codec = self.embed(torch.tensor(codec_ids, device=rows.device))
        assistant = torch.stack([text[0], text[1], text[2], tts_pad + codec[0],
                                 tts_pad + codec[1], tts_pad + codec[2], tts_pad + codec[3],
                                 tts_bos + codec[4], text[3] + codec[5]])
        return torch.cat([rows, assistant])


def talker_default_params(talker_config: dict) -> SamplingParams:
    """transformers' talker defaults: the 1024 special codec ids suppressed except eos."""
    vocab = talker_config["text_config"]["vocab_size"]
    eos = talker_config["codec_eos_token_id"]
    return SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05,
                          max_tokens=4096, stop_token_ids=[eos],
                          suppress_token_ids=[i for i in range(max(vocab - 1024, 0), vocab)
                                              if i != eos])


@dataclass
class ThinkerRows:
    """Thinker -> talker message. prompt: (first position, raw rows [n, Dt]: the thinker's
    accept-layer hidden at media placeholders, its token embedding elsewhere); reply: token
    embeddings [k, Dt] of new reply tokens, in order; specials: embeddings of <tts_bos>,
    <tts_eos>, <tts_pad> [3, Dt] (sent once)."""

    prompt: tuple[int, torch.Tensor] | None
    reply: torch.Tensor | None
    specials: torch.Tensor | None
    finished: bool


@dataclass
class TalkerFrames:
    """Talker -> code2wav message: new frames [n, K] (int64, CPU; the eos frame removed)."""

    codes: torch.Tensor = field(metadata=HOST_DATA)  # code2wav queues them on the CPU
    finished: bool


def user_positions(prompt_ids: list[int], im_start_id: int, user_id: int) -> list[int]:
    """Prompt positions inside user turns (a position belongs to the turn whose
    `<|im_start|>` last precedes it, the role being the token after that)."""
    out, role = [], None
    for i, t in enumerate(prompt_ids):
        if t == im_start_id:
            role = prompt_ids[i + 1] if i + 1 < len(prompt_ids) else None
        if role == user_id:
            out.append(i)
    return out


def assistant_start(prompt_ids: list[int], im_start_id: int, assistant_id: int) -> int | None:
    """Index of the last `<|im_start|>assistant` (the reply's turn), None without one."""
    for i in range(len(prompt_ids) - 2, -1, -1):
        if prompt_ids[i] == im_start_id and prompt_ids[i + 1] == assistant_id:
            return i
    return None


@register_adapter("qwen3_omni_thinker_to_talker")
class Qwen3OmniThinkerToTalker:
    """One request's thinker -> talker handoff (module note). `send` runs beside the thinker
    (its embedding table, its exported accept-layer rows), `receive` and the InputSource side
    (ready/rows) beside the talker (its projections). Built from plain data, so it pickles to
    stage processes; rows stay on device."""

    def __init__(self, prompt_ids: list[int], media_token_ids: list[int], ids: dict[str, int],
                 codec_ids: list[int]) -> None:
        P = len(prompt_ids)
        self.prompt_len = P
        self.prompt_ids = list(prompt_ids)
        media = set(media_token_ids)
        self.media_mask = torch.tensor([t in media for t in prompt_ids], dtype=torch.bool)
        self.user = torch.tensor(user_positions(prompt_ids, ids["im_start"], ids["user"]),
                                 dtype=torch.long)
        start = assistant_start(prompt_ids, ids["im_start"], ids["assistant"])
        if start is None or start + 3 != P:
            raise ValueError("audio output needs a chat prompt that ends with the assistant "
                             "turn's header (`<|im_start|>assistant\\n`)")
        self.assistant = start
        self.special_ids = [ids["tts_bos"], ids["tts_eos"], ids["tts_pad"]]
        self.codec_ids = codec_ids
        # thinker side
        self.sent_specials = False
        # talker side
        self.raw_prompt: torch.Tensor | None = None  # [P, Dt]
        self.num_raw = 0
        self.reply_raw: list[torch.Tensor] = []  # embeddings of reply tokens 0.. [Dt]
        self.specials: torch.Tensor | None = None
        self.prompt_rows: torch.Tensor | None = None  # [talker prompt len, D]
        self.text_rows: list[torch.Tensor] = []  # decode step j's text row (projected)
        self.eos_row = self.pad_row = None
        self.thinker_finished = False

    @property
    def talker_prompt_len(self) -> int:
        return len(self.user) + NUM_ASSISTANT_ROWS

    # ---------------------------------------------------------------- thinker side
    @torch.inference_mode()
    def send(self, ev, thinker_worker) -> ThinkerRows | None:
        """A thinker StageEvent -> its prompt rows (prefill chunks) and reply embeddings."""
        model = thinker_worker.engine.runner.model
        device = model.embed_row(0).device
        prompt = reply = specials = None
        if ev.hidden is not None and ev.hidden[0] < self.prompt_len:
            start, hidden = ev.hidden
            n = min(hidden.shape[0], self.prompt_len - start)
            emb = model.embed(torch.tensor(self.prompt_ids[start:start + n], device=device))
            exported = model.exported_rows(hidden[:n]).to(emb.dtype)
            mm = self.media_mask[start:start + n].to(device)
            prompt = (start, torch.where(mm[:, None], exported, emb))
        if len(ev.token_ids) == 1:  # a decode step: a view of the table's row (no copy, no kernel)
            reply = model.embed_row(ev.token_ids[0]).unsqueeze(0)
        elif ev.token_ids:
            reply = model.embed(torch.tensor(ev.token_ids, device=device))
        if not self.sent_specials and (prompt is not None or reply is not None):
            specials = model.embed(torch.tensor(self.special_ids, device=device))
            self.sent_specials = True
        if prompt is None and reply is None and not ev.finished:
            return None
        return ThinkerRows(prompt, reply, specials, ev.finished)

    # ---------------------------------------------------------------- talker side
    @torch.inference_mode()
    def receive(self, request_id: str, msg: ThinkerRows, talker_worker) -> None:
        talker = talker_worker.engine.runner.model
        if msg.specials is not None:
            self.specials = msg.specials
            _, self.eos_row, self.pad_row = talker.text_projection(
                msg.specials.to(talker.codec_head.weight.dtype)).unbind(0)
        if msg.prompt is not None:
            start, rows = msg.prompt
            if self.raw_prompt is None:
                self.raw_prompt = rows.new_zeros(self.prompt_len, rows.shape[-1])
            self.raw_prompt[start:start + rows.shape[0]] = rows
            self.num_raw = max(self.num_raw, start + rows.shape[0])
        finished_now = msg.finished and not self.thinker_finished
        self.thinker_finished = self.thinker_finished or msg.finished
        if msg.reply is not None:
            self.reply_raw.extend(msg.reply.unbind(0))
        if self.prompt_rows is None and self.num_raw >= self.prompt_len and self.reply_raw \
                and self.specials is not None:
            a = self.assistant
            user = self.user.to(self.raw_prompt.device)
            assistant = torch.cat([self.raw_prompt[a:a + 3], self.reply_raw[0][None]])
            self.prompt_rows = talker.project_prompt(
                self.raw_prompt[user], self.media_mask[self.user], assistant, self.specials,
                self.codec_ids)
        # text rows: reply token j + 1 for decode step j; the reply's last token -> <tts_eos>
        new = self.reply_raw[1 + len(self.text_rows):]
        if new:
            self.text_rows.extend(talker.text_projection(
                torch.stack(new).to(talker.codec_head.weight.dtype)).unbind(0))
        if finished_now and self.text_rows and len(self.reply_raw) > 1:
            self.text_rows[-1] = self.eos_row

    def ready(self, seq: Sequence) -> int:
        if self.prompt_rows is None:
            return 0
        if self.thinker_finished:
            return ALWAYS_READY
        return self.talker_prompt_len + len(self.text_rows)

    def rows(self, seq: Sequence, start: int, end: int
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        Pt, R = self.talker_prompt_len, len(self.text_rows)
        parts = []
        for pos in range(start, end):
            if pos < Pt:
                parts.append(self.prompt_rows[pos])
            else:
                j = pos - Pt
                parts.append(self.text_rows[j] if j < R else
                             self.eos_row if j == R and R == 0 else self.pad_row)
        rows = parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)
        if start >= Pt:  # decode steps: text rows are added to the codec embeddings
            return rows, None
        return rows, torch.arange(start, end, device=rows.device) < Pt


@register_adapter("qwen3_omni_talker_to_code2wav")
class Qwen3OmniTalkerToCode2Wav:
    """Forwards a talker request's frames (all codebooks) to code2wav; the eos frame is not
    audio."""

    def __init__(self, eos_token_id: int) -> None:
        self.eos = eos_token_id

    def send(self, ev, talker_worker) -> TalkerFrames | None:
        frames = [f for f in ev.codes if f[0] != self.eos]
        if ev.finished and ev.finish_reason == "length" and frames:
            # as transformers: a frame's codebooks 1.. come with the next step, which a talker
            # cut at max_tokens never runs, so its last frame is not audio
            frames = frames[:-1]
        if not frames and not ev.finished:
            return None
        codes = torch.tensor(frames, dtype=torch.long) if frames else \
            torch.zeros(0, talker_worker.engine.runner.model.num_code_groups, dtype=torch.long)
        return TalkerFrames(codes, ev.finished)

    def receive(self, request_id: str, msg: TalkerFrames, code2wav_worker) -> None:
        code2wav_worker.add_input(request_id, msg.codes, msg.finished)


def talker_prefix_key(adapter: Qwen3OmniThinkerToTalker, thinker_media: list[MediaSpan]
                      ) -> tuple[list[int], list[MediaSpan]]:
    """(hash_token_ids, media) of the talker's prefix-cache key (module note): per user-turn
    talker position i (thinker position u_i), the thinker id at u_i; a span at i keyed by the
    thinker tokens in (u_{i-1}, u_i) when there are any (dropped turns: ids and media); the
    thinker's media spans at the talker positions of their placeholders; and a private span over
    the assistant rows and what follows."""
    user = adapter.user.tolist()
    ids = [adapter.prompt_ids[u] for u in user]
    talker_at = {u: i for i, u in enumerate(user)}
    media: list[MediaSpan] = []
    previous = -1
    for i, u in enumerate(user):
        if u > previous + 1:  # thinker tokens the talker does not see come before this row
            h = hashlib.blake2b(digest_size=16)
            h.update(np.asarray(adapter.prompt_ids[previous + 1:u], dtype=np.int64).tobytes())
            for m in thinker_media:
                if m.start < u and m.end > previous + 1:
                    h.update((m.start - previous - 1).to_bytes(8, "little", signed=True))
                    h.update(m.content_hash)
            media.append(MediaSpan(i, i + 1, h.digest()))
        previous = u
    for m in thinker_media:
        inside = [talker_at[t] for t in range(m.start, m.end) if t in talker_at]
        if inside:  # (placeholders are in user turns: one run of talker positions)
            media.append(MediaSpan(inside[0], inside[-1] + 1, m.content_hash))
    media.append(MediaSpan(len(user), 1 << 62, os.urandom(16)))
    return ids, media


def talker_sequence(request_id: str, adapter: Qwen3OmniThinkerToTalker, codec_pad_id: int,
                    positions: torch.Tensor | None, rope_delta: int, params: SamplingParams,
                    seed: int, thinker_media: list[MediaSpan]) -> Sequence:
    """The talker request of a thinker request (fed by `adapter`): its prompt ids are
    placeholders (every prompt row is replaced), which the repetition penalty skips, as
    transformers' talker penalises generated codes only. positions: [3, talker prompt len]
    (None: sequential). The prefix cache sees it through talker_prefix_key (module note)."""
    n = adapter.talker_prompt_len
    if positions is None:
        positions = torch.arange(n).expand(3, -1).clone()
    hash_ids, media = talker_prefix_key(adapter, thinker_media)
    return Sequence(request_id, [codec_pad_id] * n, params, seed, mrope_positions=positions,
                    rope_delta=rope_delta, input_source=adapter, media=media,
                    hash_token_ids=hash_ids, penalize_prompt=False)
