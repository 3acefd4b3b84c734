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

import torch
from torch import nn

from omnistage.engine.ar.sequence import Sequence
from omnistage.models.interface import ForwardBatch, merge_inputs
from omnistage.models.layers import DecoderConfig, DecoderForCausalLM, DecoderModel
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
        embed_dim = talker_config["embedding_size"]
        self.model = DecoderModel(self.config, embed_dim=embed_dim)
        self.thinker_to_talker_proj = nn.Linear(embed_dim, self.config.hidden_size)
        self.codec_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.codec_ids = {name: talker_config[f"tts_codec_{name}_token_id"]
                          for name in ("start", "end", "pad", "mask")}
        self.text_ids = {name: talker_config[f"tts_text_{name}_token_id"]
                         for name in ("start", "end", "pad")}

    def tie_weights(self) -> None:
        pass

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = merge_inputs(self.embed(batch.input_ids), batch)  # [T, embedding_size]
        return self.model(self.thinker_to_talker_proj(x), batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.codec_head(hidden).float()

    def default_params(self) -> SamplingParams:
        """transformers' talker defaults."""
        c = self.codec_ids
        return SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05,
                              max_tokens=4096, stop_token_ids=[c["pad"], c["end"]],
                              suppress_token_ids=[c["start"]])


@register_adapter("qwen2_5_omni_thinker_to_talker")
class Qwen2_5OmniThinkerToTalker:
    """Collects one request's thinker rows and serves them to its talker request (an engine
    InputSource). Rows stay on the thinker's device; nothing is copied to the host."""

    def __init__(self, thinker, talker: Qwen2_5OmniTalkerForCausalLM, thinker_seq: Sequence,
                 speaker_bos_id: int, handoff: str = "qwen") -> None:
        self.thinker_seq = thinker_seq
        self.handoff = handoff
        self.prompt_len = thinker_seq.num_prompt_tokens
        media = torch.zeros(self.prompt_len, dtype=torch.bool)
        for m in thinker_seq.media:
            media[m.start:m.end] = True
        self.embed = thinker.embed
        dev = thinker.lm_head.weight.device
        self.keep_embed = (~media).to(dev)  # zero the embedding at media placeholders
        special = torch.tensor([speaker_bos_id, talker.text_ids["end"], talker.text_ids["pad"]],
                               device=dev)
        self.bos_row, self.eos_row, self.pad_row = self.embed(special)
        width = self.bos_row.shape[-1]
        self.prompt_rows = torch.zeros(self.prompt_len, width, device=dev,
                                       dtype=self.bos_row.dtype)
        self.num_prompt_rows = 0
        self.reply_rows: list[torch.Tensor] = []
        self.thinker_finished = False

    # ---------------------------------------------------------------- thinker side
    def add_thinker_rows(self, start: int, hidden: torch.Tensor) -> None:
        """hidden: [n, D] final-norm states of thinker positions [start, start+n)."""
        n = hidden.shape[0]
        seq = self.thinker_seq
        ids = torch.tensor([seq.token_id(i) for i in range(start, start + n)],
                           device=hidden.device)
        rows = hidden + self.embed(ids)
        P = self.prompt_len
        if start < P:
            k = min(n, P - start)
            keep = self.keep_embed[start:start + k, None]
            self.prompt_rows[start:start + k] = hidden[:k] + self.embed(ids[:k]) * keep
            self.num_prompt_rows = start + k
        for i in range(max(start, P), start + n):  # reply rows, one per fed-back reply token
            self.reply_rows.append(rows[i - start])

    def finish_thinker(self) -> None:
        self.thinker_finished = True

    def on_event(self, ev) -> None:
        """Route a thinker StageEvent: hidden rows in, and the end of the reply."""
        if ev.hidden is not None:
            self.add_thinker_rows(*ev.hidden)
        if ev.finished:
            self.finish_thinker()

    # ---------------------------------------------------------------- talker side
    def ready(self, seq: Sequence) -> int:
        if self.num_prompt_rows < self.prompt_len:
            return 0
        if self.thinker_finished:
            return ALWAYS_READY
        return self.prompt_len + 1 + len(self.reply_rows)

    def rows(self, seq: Sequence, start: int, end: int
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        P, R = self.prompt_len, len(self.reply_rows)
        parts = []
        for pos in range(start, end):
            if pos < P:
                parts.append(self.prompt_rows[pos])
            elif pos == P:
                parts.append(self.bos_row)
            else:
                j = pos - P - 1
                parts.append(self.reply_rows[j] if j < R else
                             self.eos_row if j == R else self.pad_row)
        # rows replace the codec embedding in the prompt; "transformers5" also at P and P+1
        replace_upto = P if self.handoff == "qwen" else P + 2
        if start >= replace_upto:  # decode steps: rows are only added (no mask, no host sync)
            return torch.stack(parts), None
        replace = torch.arange(start, end, device=self.bos_row.device) < replace_upto
        return torch.stack(parts), replace


@register_adapter("qwen2_5_omni_talker_to_code2wav")
class Qwen2_5OmniTalkerToCode2Wav:
    """Forwards a talker request's codes to code2wav; the stop code is not a code."""

    def __init__(self, code2wav, stop_token_ids: list[int]) -> None:
        self.code2wav, self.stops = code2wav, set(stop_token_ids)
        self.codes: list[int] = []

    def on_event(self, ev) -> None:
        codes = list(ev.token_ids)
        if ev.finished and ev.finish_reason == "stop" and codes and codes[-1] in self.stops:
            codes = codes[:-1]
        self.codes.extend(codes)
        if codes or ev.finished:
            self.code2wav.add_codes(ev.request_id, codes, ev.finished)


def talker_sequence(request_id: str, thinker_seq: Sequence, adapter: Qwen2_5OmniThinkerToTalker,
                    talker: Qwen2_5OmniTalkerForCausalLM, params: SamplingParams,
                    seed: int) -> Sequence:
    """The talker request of a thinker request (its prompt rows must be complete)."""
    P = thinker_seq.num_prompt_tokens
    c = talker.codec_ids
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
    return Sequence(request_id, ids, params, seed, mrope_positions=positions,
                    rope_delta=top + 3 - (P + 2), input_source=adapter, cacheable=False)
