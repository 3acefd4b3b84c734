"""Qwen2.5-Omni talker on the AR engine, and the thinker -> talker adapter that feeds it.

NOTE (the handoff, as transformers' generate builds it): a thinker row is the final-norm
hidden state plus the input embedding at that position (the embedding is zeroed at media
placeholders). Reply row i exists once reply token i was fed back to the thinker. The talker
sees, per position:
  0..P-1   the thinker's prompt rows, replacing the codec embedding (ids: codec mask)
  P        thinker embedding of the voice's bos token + codec pad embedding
  P+1+j    reply row j + codec embedding of the previous code (bos at j = 0) while rows last;
           once the thinker has finished with R rows: row R = embedding of <|tts_eos|>, and
           <|tts_pad|> embeddings after that
and runs them through thinker_to_talker_proj before its own decoder; its 3-axis positions are
the thinker prompt's, then two text positions.

NOTE: transformers 5.x's generate drops an all-ones attention mask before calling the talker,
and the talker's forward computes the mrope positions and adds the codec pad/bos embeddings
only when a mask is given; so transformers 5 actually runs the talker with sequential 1-D
positions and without those two codec embeddings. HANDOFFS names both: "qwen" (the design
above, the default) and "transformers5" (bit-compatible with transformers 5.23)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from omnistage.engine.ar.sequence import MediaSpan, Sequence
from omnistage.engine.ar.interface import ForwardBatch, merge_inputs
from omnistage.layers.parallel import current_tp
from omnistage.models.layers import (DecoderConfig, DecoderForCausalLM, DecoderModel,
                                     parallel_lm_head)
from omnistage.models.registry import register_adapter, register_model
from omnistage.sampling_params import SamplingParams

ALWAYS_READY = 1 << 40
HANDOFFS = ("qwen", "transformers5")


@register_model("Qwen2_5OmniTalker")
class Qwen2_5OmniTalkerForCausalLM(DecoderForCausalLM):
    """Checkpoint names (after `talker.`): model.*, thinker_to_talker_proj.*, codec_head.*"""

    def __init__(self, talker_config: dict) -> None:
        nn.Module.__init__(self)
        self.config = DecoderConfig.from_hf(dict(talker_config, tie_word_embeddings=False),
                                            attention_bias=True)
        self.tp = current_tp()
        embed_dim = talker_config["embedding_size"]
        self.model = DecoderModel(self.config, embed_dim=embed_dim)
        # NOTE (tensor parallelism): the codec embedding and head split over the codec
        # vocabulary, the decoder as a causal LM's; the input projection stays whole on every
        # rank (embedding_size x hidden: small beside the decoder), fed the full rows that the
        # embedding's all-reduce and the step message give every rank
        self.thinker_to_talker_proj = nn.Linear(embed_dim, self.config.hidden_size)
        self.codec_head = parallel_lm_head(self.config.hidden_size, self.config.vocab_size,
                                           self.model.embed_tokens, self.tp, tied=False)
        self.codec_ids, self.text_ids = talker_token_ids(talker_config)

    def tie_weights(self) -> None:
        pass

    @classmethod
    def supports_tensor_parallel(cls) -> bool:
        return True  # its forward embeds through the (collective) vocab-parallel table

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        # the module call: collective under tensor parallelism (embed() is a local lookup)
        x = merge_inputs(self.input_embedding(batch.input_ids), batch)  # [T, embedding_size]
        return self.model(self.thinker_to_talker_proj(x), batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.codec_head(hidden).float()

    def default_params(self) -> SamplingParams:
        return talker_default_params(self.codec_ids)


def talker_token_ids(talker_config: dict) -> tuple[dict[str, int], dict[str, int]]:
    """(codec ids: start/end/pad/mask, thinker text ids: start/end/pad) from the config."""
    codec = {name: talker_config[f"tts_codec_{name}_token_id"]
             for name in ("start", "end", "pad", "mask")}
    text = {name: talker_config[f"tts_text_{name}_token_id"] for name in ("start", "end", "pad")}
    return codec, text


def talker_default_params(codec_ids: dict[str, int]) -> SamplingParams:
    """transformers' talker defaults."""
    c = codec_ids
    return SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05,
                          max_tokens=4096, stop_token_ids=[c["pad"], c["end"]],
                          suppress_token_ids=[c["start"]])


@dataclass
class ThinkerRows:
    """Thinker -> talker message: talker-ready rows of thinker positions [start, start + n)."""

    start: int
    rows: torch.Tensor  # [n, D] final-norm hidden + input embedding (zeroed at media)
    specials: torch.Tensor | None  # [3, D] embeddings of voice bos, <|tts_eos|>, <|tts_pad|>
    finished: bool  # the thinker's reply has ended


@dataclass
class TalkerCodes:
    """Talker -> code2wav message: new codes (stop code removed)."""

    codes: list[int]
    finished: bool


@register_adapter("qwen2_5_omni_thinker_to_talker")
class Qwen2_5OmniThinkerToTalker:
    """One request's thinker -> talker handoff. `send` runs beside the thinker (it needs the
    thinker's embedding table), `receive` and the InputSource side (ready/rows) beside the
    talker. Built from plain data, so it pickles to stage processes; rows stay on device."""

    def __init__(self, prompt_ids: list[int], media: list[tuple[int, int]], speaker_bos_id: int,
                 text_ids: dict[str, int], handoff: str = "qwen") -> None:
        self.handoff = handoff
        self.prompt_len = len(prompt_ids)
        self.media = media
        self.special_ids = [speaker_bos_id, text_ids["end"], text_ids["pad"]]
        # thinker side: the ids fed at each position (prompt, then the reply fed back)
        self.fed_ids = list(prompt_ids)
        self.sent_specials = False
        # talker side
        self.prompt_rows: torch.Tensor | None = None
        self.num_prompt_rows = 0
        self.reply_rows: list[torch.Tensor] = []
        # rows of voice bos, <|tts_eos|>, <|tts_pad|>: unbound once (unpacking the tensor at
        # every step cost an unbind per request per talker step)
        self.specials: tuple[torch.Tensor, ...] | None = None
        self.thinker_finished = False

    # ---------------------------------------------------------------- thinker side
    @torch.inference_mode()
    def send(self, ev, thinker_worker) -> ThinkerRows | None:
        """A thinker StageEvent -> the rows it completes (and the end of the reply)."""
        embed = thinker_worker.engine.runner.model.embed
        rows = specials = None
        start = 0
        if ev.hidden is not None:
            start, hidden = ev.hidden
            n = hidden.shape[0]
            if n == 1 and not any(m0 <= start < m1 for m0, m1 in self.media):
                # NOTE: a decode step's row: one add kernel and no host->device copy of the
                # id. H100, 64 requests at once: the thinker's collect (which runs this per
                # request) took 7.8 -> 3.3-3.9 ms per step
                rows = hidden + thinker_worker.engine.runner.model.embed_row(self.fed_ids[start])
            else:
                ids = torch.tensor(self.fed_ids[start:start + n], device=hidden.device)
                emb = embed(ids)
                for m0, m1 in self.media:  # media placeholders keep only the hidden state
                    lo, hi = max(m0, start), min(m1, start + n)
                    if lo < hi:
                        emb[lo - start:hi - start] = 0
                rows = hidden + emb
            if not self.sent_specials:
                specials = embed(torch.tensor(self.special_ids, device=hidden.device))
                self.sent_specials = True
        self.fed_ids.extend(ev.token_ids)  # fed back at the next positions
        if rows is None and not ev.finished:
            return None
        if rows is None:
            rows = torch.zeros(0, 1)
        return ThinkerRows(start, rows, specials, ev.finished)

    # ---------------------------------------------------------------- talker side
    def receive(self, request_id: str, msg: ThinkerRows, talker_worker) -> None:
        P = self.prompt_len
        if msg.specials is not None:
            self.specials = tuple(msg.specials.unbind(0))
        n = msg.rows.shape[0]
        if n and self.prompt_rows is None:
            self.prompt_rows = msg.rows.new_zeros(P, msg.rows.shape[-1])
        if msg.start < P and n:
            k = min(n, P - msg.start)
            self.prompt_rows[msg.start:msg.start + k] = msg.rows[:k]
            self.num_prompt_rows = max(self.num_prompt_rows, msg.start + k)
        # reply rows by position: a recomputed (preempted) thinker re-sends rows it sent before
        for i in range(max(msg.start, P + len(self.reply_rows)), msg.start + n):
            self.reply_rows.append(msg.rows[i - msg.start])
        self.thinker_finished = self.thinker_finished or msg.finished

    def ready(self, seq: Sequence) -> int:
        if self.num_prompt_rows < self.prompt_len or self.specials is None:
            return 0
        if self.thinker_finished:
            return ALWAYS_READY
        return self.prompt_len + 1 + len(self.reply_rows)

    def rows(self, seq: Sequence, start: int, end: int
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        P, R = self.prompt_len, len(self.reply_rows)
        bos_row, eos_row, pad_row = self.specials
        parts = []
        for pos in range(start, end):
            if pos < P:
                parts.append(self.prompt_rows[pos])
            elif pos == P:
                parts.append(bos_row)
            else:
                j = pos - P - 1
                parts.append(self.reply_rows[j] if j < R else eos_row if j == R else pad_row)
        # rows replace the codec embedding in the prompt; "transformers5" also at P and P+1
        replace_upto = P if self.handoff == "qwen" else P + 2
        if start >= replace_upto:  # decode steps: rows are only added (no mask, no host sync)
            return (parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)), None
        replace = torch.arange(start, end, device=bos_row.device) < replace_upto
        return torch.stack(parts), replace


@register_adapter("qwen2_5_omni_talker_to_code2wav")
class Qwen2_5OmniTalkerToCode2Wav:
    """Forwards a talker request's codes to code2wav; the stop code is not a code."""

    def __init__(self, stop_token_ids: list[int]) -> None:
        self.stops = set(stop_token_ids)

    def send(self, ev, talker_worker) -> TalkerCodes | None:
        codes = list(ev.token_ids)
        if ev.finished and ev.finish_reason == "stop" and codes and codes[-1] in self.stops:
            codes = codes[:-1]
        if not codes and not ev.finished:
            return None
        return TalkerCodes(codes, ev.finished)

    def receive(self, request_id: str, msg: TalkerCodes, code2wav_worker) -> None:
        code2wav_worker.add_input(request_id, msg.codes, msg.finished)


def talker_sequence(request_id: str, thinker_seq: Sequence, adapter: Qwen2_5OmniThinkerToTalker,
                    codec_ids: dict[str, int], params: SamplingParams, seed: int) -> Sequence:
    """The talker request of a thinker request (fed by `adapter`)."""
    P = thinker_seq.num_prompt_tokens
    c = codec_ids
    ids = [c["mask"]] * P + [c["pad"], c["start"]]
    if adapter.handoff == "transformers5":
        return Sequence(request_id, ids, params, seed,
                        mrope_positions=torch.arange(P + 2).expand(3, -1).clone(),
                        input_source=adapter, cacheable=False)
    # positions: the thinker prompt's, then two text positions (voice bos, first reply token)
    pos = thinker_seq.mrope_positions
    top = int(pos.max()) if pos is not None else P - 1
    extra = torch.tensor([top + 1, top + 2]).expand(3, -1)
    positions = torch.cat([pos.cpu() if pos is not None else
                           torch.arange(P).expand(3, -1), extra], dim=1)
    # Prefix cache: a prompt position's KV is set by the thinker's prompt up to it (its rows,
    # the positions), so the hash takes the thinker's ids and media there; from P on it depends
    # on the voice and the reply, so a span unique to this request keeps those blocks private.
    media = [MediaSpan(m.start, m.end, m.content_hash) for m in thinker_seq.media]
    media.append(MediaSpan(P, 1 << 62, os.urandom(16)))
    return Sequence(request_id, ids, params, seed, mrope_positions=positions,
                    rope_delta=top + 3 - (P + 2), input_source=adapter, media=media,
                    hash_token_ids=list(thinker_seq.prompt_token_ids))
