"""The non-AR engine's options: one frozen dataclass, read once when a worker is built.

None means "the device's default", filled in by `resolve(device)`: the CUDA defaults are the
measured best ones for code2wav (measured: benchmarks/results/
qwen2_5_omni_pipeline_gpu_h100_chunk24_preempt3_2026-11-23.json and its neighbours)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

MAX_BATCH = 32  # the largest graph bucket: one graph per step


def _check_flag(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}: true, false or None (the device's default), got {value!r}")


@dataclass(frozen=True)
class GenEngineConfig:
    """max_batch: requests per step (at most the largest batch bucket).
    cuda_graphs: "auto" = capture graphs on CUDA; "off" = eager everywhere.
    compile: torch.compile the graphed shapes before their capture (only with graphs; a
    machine where inductor cannot build falls back to uncompiled graphs with a warning).
    launch_thread: queue a streaming step's GPU work from a thread of the worker's own (None:
    on for CUDA). A big graph launch blocks the calling thread for most of its run; on the
    thread the runtime's loop goes on launching the other stages.
    first_output_alone: a step holding the first outputs of every request still waiting for its
    first output runs with the GPU to itself (exclusive; None: on for CUDA).
    preempt_parts: a step of later outputs runs in parts of this many intervals, a step of
    first outputs going between two parts (0: whole steps; None: 3 on CUDA, 0 elsewhere).
    free_sms: SMs a step `beside` other stages leaves to them (a CUDA green context; 0 = off;
    "auto" = a quarter of the GPU's in multiples of 8, 0 without graphs or green contexts).
    warmup: capture the model's graphs when the worker is built (None: on for CUDA).
    warmup_plan: "full" = every graph at that warm-up; "lazy" = only those a first request
    needs (batch 1), the others captured one per idle gap of the stage, on its own thread,
    while steps needing one not captured yet run on a larger captured bucket or eagerly
    (models without lazy capture, GenModel.capture_next, capture everything)."""

    max_batch: int = MAX_BATCH
    cuda_graphs: Literal["auto", "off"] = "auto"
    compile: bool = True
    launch_thread: bool | None = None
    first_output_alone: bool | None = None
    preempt_parts: int | None = None
    free_sms: int | Literal["auto"] = "auto"
    warmup: bool | None = None
    warmup_plan: Literal["full", "lazy"] = "full"

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch, int) or isinstance(self.max_batch, bool) \
                or self.max_batch < 1:
            raise ValueError(f"max_batch: an int >= 1, got {self.max_batch!r}")
        if self.cuda_graphs not in ("auto", "off"):
            raise ValueError(f"cuda_graphs: 'auto' or 'off', got {self.cuda_graphs!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile: true or false, got {self.compile!r}")
        for name in ("launch_thread", "first_output_alone", "warmup"):
            _check_flag(name, getattr(self, name))
        p = self.preempt_parts
        if p is not None and (not isinstance(p, int) or isinstance(p, bool) or p < 0):
            raise ValueError(f"preempt_parts: an int >= 0 or None, got {p!r}")
        if self.warmup_plan not in ("full", "lazy"):
            raise ValueError(f"warmup_plan: 'full' or 'lazy', got {self.warmup_plan!r}")
        s = self.free_sms
        if s != "auto" and (not isinstance(s, int) or isinstance(s, bool) or s < 0):
            raise ValueError(f"free_sms: an int >= 0 or 'auto', got {s!r}")

    def resolve(self, device: torch.device) -> GenEngineConfig:
        """This config with every None set to the device's default."""
        cuda = device.type == "cuda"

        def pick(value: bool | None) -> bool:
            return cuda if value is None else value

        return replace(self, launch_thread=pick(self.launch_thread),
                       first_output_alone=pick(self.first_output_alone), warmup=pick(self.warmup),
                       preempt_parts=(3 if cuda else 0) if self.preempt_parts is None
                       else self.preempt_parts)

    def use_graphs(self, device: torch.device) -> bool:
        return self.cuda_graphs == "auto" and device.type == "cuda"


# constructor keyword of a code2wav stage's engine option -> its GenEngineConfig field
ENGINE_KEYWORDS = {"code2wav_max_batch": "max_batch", "code2wav_cuda_graphs": "cuda_graphs",
                   "code2wav_compile": "compile", "code2wav_launch_thread": "launch_thread",
                   "code2wav_first_alone": "first_output_alone",
                   "code2wav_preempt": "preempt_parts", "code2wav_free_sms": "free_sms",
                   "code2wav_warmup": "warmup", "code2wav_warmup_plan": "warmup_plan"}


def pop_stage_options(opts: dict[str, Any], model_cls: type, model_keywords: dict[str, str],
                      absent: dict[str, Any] | None = None) -> tuple[GenEngineConfig, Any]:
    """Take a gen stage's `code2wav_*` keyword options out of opts -> (GenEngineConfig, the
    family's options, model_cls). A keyword absent or None takes the default, except the
    model fields in `absent` (field -> value when absent), for which None is a value; a bad
    value raises ValueError naming its keyword."""
    absent = absent or {}
    fields: list[dict[str, Any]] = [{}, {}]
    for i, (cls, keywords) in enumerate(((GenEngineConfig, ENGINE_KEYWORDS),
                                         (model_cls, model_keywords))):
        for keyword, name in keywords.items():
            keep_none = i == 1 and name in absent
            value = opts.pop(keyword, absent.get(name) if keep_none else None)
            if value is None and not keep_none:
                continue
            try:
                cls(**{name: value})
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{keyword}: {exc}") from exc
            fields[i][name] = value
    return GenEngineConfig(**fields[0]), model_cls(**fields[1])
