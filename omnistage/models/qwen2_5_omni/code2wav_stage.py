"""code2wav as a generation stage: codes arrive from the talker; finished utterances are
decoded together, several per batched DiT pass (one ODE per batch, not per utterance)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav
from omnistage.models.registry import register_model
from omnistage.runtime.stage import StageEvent

register_model("Qwen2_5OmniToken2Wav")(Qwen2_5OmniToken2Wav)

MAX_BATCH = 16


@dataclass
class Code2WavRequest:
    cond: torch.Tensor  # [enc_emb_dim] speaker vector (fp32, device)
    ref_mel: torch.Tensor  # [frames, 80] reference mel (fp32, device)
    seed: int
    codes: list[int] = field(default_factory=list)
    codes_finished: bool = False


class Qwen2_5OmniCode2WavStage:
    def __init__(self, name: str, model: Qwen2_5OmniToken2Wav, device: torch.device) -> None:
        self.name, self.model, self.device = name, model, device
        self.requests: dict[str, Code2WavRequest] = {}
        self.batch_sizes: list[int] = []
        self.busy_seconds = 0.0

    def submit(self, request_id: str, request: Code2WavRequest) -> None:
        self.requests[request_id] = request

    def add_codes(self, request_id: str, codes: list[int], finished: bool) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.codes_finished:
            raise ValueError(f"code2wav: codes for {request_id} after the last one")
        req.codes.extend(codes)
        req.codes_finished = finished

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_work(self) -> bool:
        return any(r.codes_finished for r in self.requests.values())

    def step(self) -> list[StageEvent]:
        ready = [(rid, r) for rid, r in self.requests.items() if r.codes_finished][:MAX_BATCH]
        events = [StageEvent(self.name, rid, finished=True, finish_reason="stop")
                  for rid, r in ready if not r.codes]  # nothing to say: an empty utterance
        ready = [(rid, r) for rid, r in ready if r.codes]
        for rid, _ in ready:
            del self.requests[rid]
        for ev in events:
            self.requests.pop(ev.request_id, None)
        if not ready:
            return events
        dev = self.device
        codes = [torch.tensor(r.codes, dtype=torch.long, device=dev) for _, r in ready]
        noises = [Qwen2_5OmniToken2Wav.initial_noise(r.seed, 2 * len(r.codes)).to(dev)
                  for _, r in ready]
        _, wavs = self.model.generate(codes, [r.cond for _, r in ready],
                                      [r.ref_mel for _, r in ready], noises)
        self.batch_sizes.append(len(ready))
        for (rid, _), wav in zip(ready, wavs):
            events.append(StageEvent(self.name, rid, token_ids=[],
                                     audio=wav.float().cpu().numpy(), finished=True,
                                     finish_reason="stop"))
        return events

    def fail_all(self, error: str) -> list[StageEvent]:
        events = [StageEvent(self.name, rid, finished=True, finish_reason="error", error=error)
                  for rid in self.requests]
        self.requests.clear()
        return events

    def stats(self) -> dict[str, float]:
        return {"queue": len(self.requests),
                "batch_size": self.batch_sizes[-1] if self.batch_sizes else 0,
                "max_batch_size": max(self.batch_sizes, default=0),
                "busy_seconds": self.busy_seconds}
