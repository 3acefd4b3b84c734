"""Diffusion stages on the non-AR engine: denoising with step-level batching, and one-shot
batched stages (prompt encoders, VAE decoders). A family supplies the networks
(`DiffusionTransformer`, a batched function for one-shot stages); the engine owns batching,
CFG as batch doubling, the Euler update, progress and the data handed between stages.

Denoising: an output of a request is one denoising step of its images. GenStageWorker runs the
next step of every ready request together (requests at different timesteps share a batch and
join and leave between steps); `batch_key` keeps one latent shape per batch (rope tables and
graphs are per size); `batch_rows` counts images x 2 where CFG runs that step. The last step's
output hands the latents (`payload`) to the decoder stage through the request's link."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from omnistage.engine.gen.model import GenRequest


class DiffusionTransformer(Protocol):
    """What a family's denoiser network gives the engine."""

    dit: torch.nn.Module  # the network holding its weights (placement logs, statistics)

    def predict(self, latents: Tensor, timesteps: Tensor, text: Tensor, text_mask: Tensor | None,
                grid: tuple[int, ...]) -> Tensor:
        """The flow velocity (fp32 or the compute dtype) for rows of latents [R, ...] in the
        compute dtype at per-row timesteps (the scheduler's t, 0..1000, fp32 [R]), text
        [R, T, D] right-padded, text_mask [R, T] bool (None: no padding); grid: the batch's
        DenoiseRequest.grid."""

    def guide(self, cond: Tensor, uncond: Tensor, scale: float, options: dict[str, Any]
              ) -> Tensor:
        """The guided velocity of one request's images from its cond and uncond rows (fp32)."""

    def compile(self) -> None:
        """torch.compile its blocks (the engine then warms them up: `example`)."""

    def first(self, latents: Tensor, timesteps: Tensor, text: Tensor, text_mask: Tensor | None,
              grid: tuple[int, ...]) -> tuple[Any, Tensor]:
        """predict() split for the step cache: embeddings and the first block -> (state, the
        first block's change of the image tokens [R, ...] (the probe))."""

    def rest(self, state: Any, rows: Tensor | None) -> Tensor:
        """The later blocks' change of the image tokens for `rows` (None: all) of the batch."""

    def finish(self, state: Any, residual: Tensor) -> Tensor:
        """The velocity from the first block's state plus the later blocks' change."""

    def example(self, rows: int, text_len: int, size: int, padded: bool) -> tuple:
        """predict()'s arguments for `rows` random rows of a size x size image (warm-up);
        padded: a text mask whose rows have different lengths."""


@dataclass
class DenoiseRequest:
    """What an image pipeline submits to its denoising stage for one prompt (plain data)."""

    noise: Tensor  # [n, *shape] fp32 on the CPU: the initial latents of the n images
    sigmas: list[float]  # num_steps + 1, the last one the terminal 0
    timesteps: list[float]  # num_steps: the scheduler's t per step
    guidance: list[float]  # per step: the CFG scale, 0 = no uncond rows at that step
    grid: tuple[int, ...] = ()  # the family's size key (e.g. latent patches h, w): one per batch
    row_weight: int = 1  # what one image row counts against max_batch (larger images: more)
    options: dict[str, Any] = field(default_factory=dict)  # the family's guide() options

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)


@dataclass(kw_only=True)
class DenoiseState(GenRequest):
    request: DenoiseRequest
    latents: Tensor  # [n, *shape] fp32 on the device
    step: int = 0
    text: Tensor | None = None  # [T, D] the prompt's embeddings (once the encoder sent them)
    negative: Tensor | None = None  # [T', D] the negative prompt's (when CFG runs)

    # step cache: the first block's change (probe) and the later blocks' change (residual) of
    # its rows at its last fully computed step, and the steps it reused them
    probe: Tensor | None = None
    residual: Tensor | None = None
    cached_steps: int = 0

    def uses_cfg(self) -> bool:
        return self.request.guidance[self.step] > 0


def pad_rows(rows: Sequence[Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """Right-pad [T_i, D] rows to [R, T, D] with a [R, T] bool mask (None when none is padded)."""
    longest = max(r.shape[0] for r in rows)
    out = rows[0].new_zeros(len(rows), longest, rows[0].shape[-1], dtype=dtype)
    mask = torch.zeros(len(rows), longest, dtype=torch.bool, device=out.device)
    for i, r in enumerate(rows):
        out[i, :r.shape[0]] = r
        mask[i, :r.shape[0]] = True
    return out, (None if all(r.shape[0] == longest for r in rows) else mask)


# warm-up calls (rows, text length, image side, padded text) that leave compiled blocks with
# every graph a request needs: static first, then B / T / L dynamic (B >= 2), then B = 1 with
# T / L dynamic; the same for batches whose texts differ in length (a key mask)
WARMUP_SHAPES = ((1, 16, 1024, False), (2, 23, 768, False), (1, 31, 512, False),
                 (2, 23, 1024, True), (3, 29, 768, True))


class Denoiser:
    """The GenModel of a denoising stage (see the module note). compile: torch.compile the
    network's blocks (CUDA), compiled by warmup() when the worker is built, so no request
    waits for a compile.

    step_cache (first-block cache; None: off): every row runs the first block; a request whose
    first-block change differs from the one of its last fully computed step by less than this
    relative L1 distance skips the later blocks and reuses their change from that step."""

    streaming = True

    def __init__(self, network: DiffusionTransformer, device: torch.device,
                 dtype: torch.dtype, compile: bool = False,
                 step_cache: float | None = None) -> None:
        self.network, self.device, self.dtype = network, device, dtype
        self.step_cache = step_cache
        self.cached_rows = 0
        self.module = network.dit
        self.compiled = compile
        if compile:
            network.compile()
        self.steps = 0
        self.rows = 0
        self.warmup_seconds = 0.0

    def new_state(self, request: DenoiseRequest) -> DenoiseState:
        return DenoiseState(request=request, latents=request.noise.to(self.device))

    def add_input(self, state: DenoiseState, data: dict[str, Tensor | None],
                  finished: bool) -> None:
        state.text, state.negative = data["text"], data.get("negative")

    def ready(self, state: DenoiseState) -> bool:
        return state.text is not None and state.step < state.request.num_steps

    def empty(self, state: DenoiseState) -> bool:
        return False

    def input_pending(self, state: DenoiseState) -> bool:
        return state.text is None

    def done(self, state: DenoiseState) -> bool:
        return state.step >= state.request.num_steps

    def batch_key(self, state: DenoiseState) -> Hashable:
        return state.request.grid, tuple(state.latents.shape[1:])

    def batch_rows(self, state: DenoiseState) -> int:
        cfg = 2 if self.ready(state) and state.uses_cfg() else 1
        return state.latents.shape[0] * cfg * state.request.row_weight

    def is_held(self, batch: Sequence[DenoiseState]) -> bool:
        return False

    def intervals(self, batch: Sequence[DenoiseState]) -> int:
        return 1

    def run(self, batch: Sequence[DenoiseState]) -> list[dict[str, Any]]:
        """One denoising step of every request in the batch: cond rows of all, then uncond rows
        of those guided at their step, in one network call; Euler in fp32."""
        cfg = [s for s in batch if s.uses_cfg()]
        latents = torch.cat([s.latents for s in batch] + [s.latents for s in cfg])
        texts = [s.text for s in batch for _ in range(len(s.latents))]
        texts += [s.negative for s in cfg for _ in range(len(s.latents))]
        text, mask = pad_rows(texts, self.dtype)
        t = torch.tensor([s.request.timesteps[s.step] for s in batch for _ in s.latents]
                         + [s.request.timesteps[s.step] for s in cfg for _ in s.latents],
                         dtype=torch.float32).to(self.device, non_blocking=True)
        args = (latents.to(self.dtype), t, text, mask, batch[0].request.grid)
        if self.step_cache is None:
            velocity = self.network.predict(*args).float()
        else:
            velocity = self._predict_cached(batch, cfg, args).float()
        self.steps += 1
        self.rows += latents.shape[0]
        outputs, row, uncond_row = [], 0, sum(len(s.latents) for s in batch)
        for s in batch:
            n, req = len(s.latents), s.request
            v = velocity[row:row + n]
            row += n
            if s.uses_cfg():
                v = self.network.guide(v, velocity[uncond_row:uncond_row + n],
                                       req.guidance[s.step], req.options)
                uncond_row += n
            s.latents = s.latents + (req.sigmas[s.step + 1] - req.sigmas[s.step]) * v
            s.step += 1
            fields: dict[str, Any] = {"progress": (s.step, req.num_steps)}
            if s.step == req.num_steps:
                fields["payload"] = (s.latents, req.grid)  # to the decoder stage
            outputs.append(fields)
        return outputs

    def _predict_cached(self, batch: Sequence[DenoiseState], cfg: Sequence[DenoiseState],
                        args: tuple) -> Tensor:
        """predict() with the first-block cache (see the class note)."""
        state, probe = self.network.first(*args)
        rows: list[list[int]] = []  # each request's rows: its cond rows, then its uncond rows
        at, uncond_at = 0, sum(len(s.latents) for s in batch)
        guided = {id(s) for s in cfg}
        for s in batch:
            n = len(s.latents)
            own = list(range(at, at + n))
            at += n
            if id(s) in guided:
                own += range(uncond_at, uncond_at + n)
                uncond_at += n
            rows.append(own)
        index = [torch.tensor(r, device=probe.device) for r in rows]
        comparable = [s.probe is not None and s.probe.shape == probe[i].shape
                      for s, i in zip(batch, index)]
        distances = [((probe[i] - s.probe).abs().mean() / s.probe.abs().mean()) if ok else None
                     for s, i, ok in zip(batch, index, comparable)]
        known = [d for d in distances if d is not None]
        values = iter(torch.stack(known).tolist() if known else [])  # (one host sync)
        reuse = [d is not None and next(values) < self.step_cache for d in distances]
        compute = [i for i, r in zip(index, reuse) if not r]
        if len(compute) == len(batch):
            residual = self.network.rest(state, None)
        else:
            residual = torch.empty_like(probe)
            if compute:
                computed_rows = torch.cat(compute)
                residual[computed_rows] = self.network.rest(state, computed_rows)
        for s, i, r in zip(batch, index, reuse):
            if r:
                residual[i] = s.residual
                s.cached_steps += 1
                self.cached_rows += len(i)
            else:
                s.probe, s.residual = probe[i], residual[i]
        return self.network.finish(state, residual)

    def begin(self, batch: Sequence[DenoiseState], beside: bool) -> Sequence[DenoiseState]:
        return batch

    def advance(self, job: Sequence[DenoiseState], intervals: int) -> bool:
        return True

    def finish(self, job: Sequence[DenoiseState]) -> list[dict[str, Any]]:
        return self.run(job)

    def outputs(self, result: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
        return result

    def warmup(self, buckets: tuple[int, ...] | None = None) -> None:
        """Compile now (the first calls of compiled blocks), not in a request."""
        if not self.compiled:
            return
        start = time.perf_counter()
        for rows, text_len, size, padded in WARMUP_SHAPES:
            self.network.predict(*self.network.example(rows, text_len, size, padded))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_seconds = time.perf_counter() - start

    def drop_jobs(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {"denoise_steps": self.steps, "denoise_rows": self.rows,
                "step_cache_reused_rows": self.cached_rows,
                "warmup_seconds": self.warmup_seconds}


@dataclass(kw_only=True)
class OneShotState(GenRequest):
    request: Any  # what the pipeline submitted (e.g. token ids)
    data: Any = None  # the upstream stage's payload (None: the request itself is the input)
    needs_input: bool = False


class OneShot:
    """The GenModel of a one-shot stage: each request has one output, computed whole for a batch
    of ready requests by `run_batch(list of inputs) -> list of StageEvent field dicts` (a text
    encoder: token ids -> embeddings; a VAE: latents -> images). key(input) groups a batch
    (e.g. latent shape); rows(input) counts its rows against max_batch."""

    streaming = False

    def __init__(self, run_batch: Callable[[list[Any]], list[dict[str, Any]]],
                 needs_input: bool, key: Callable[[Any], Hashable] = lambda item: None,
                 rows: Callable[[Any], int] = lambda item: 1,
                 module: torch.nn.Module | None = None) -> None:
        self.run_batch, self.needs_input = run_batch, needs_input  # (run_batch also warms up)
        self.module = module  # the network holding its weights (placement logs)
        self.key, self.rows = key, rows
        self.batches = 0

    def _input(self, state: OneShotState) -> Any:
        return state.data if self.needs_input else state.request

    def new_state(self, request: Any) -> OneShotState:
        return OneShotState(request=request, needs_input=self.needs_input)

    def add_input(self, state: OneShotState, data: Any, finished: bool) -> None:
        state.data = data

    def ready(self, state: OneShotState) -> bool:
        return not self.needs_input or state.data is not None

    def empty(self, state: OneShotState) -> bool:
        return False

    def input_pending(self, state: OneShotState) -> bool:
        return not self.ready(state)

    def done(self, state: OneShotState) -> bool:
        return True

    def batch_key(self, state: OneShotState) -> Hashable:
        return self.key(self._input(state))

    def batch_rows(self, state: OneShotState) -> int:
        return self.rows(self._input(state))

    def is_held(self, batch: Sequence[OneShotState]) -> bool:
        return False

    def intervals(self, batch: Sequence[OneShotState]) -> int:
        return 1

    def run(self, batch: Sequence[OneShotState]) -> list[dict[str, Any]]:
        self.batches += 1
        return self.run_batch([self._input(s) for s in batch])

    def outputs(self, result: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
        return result

    def begin(self, batch: Sequence[OneShotState], beside: bool) -> Any:
        raise RuntimeError("a one-shot stage runs whole steps (it is not streaming)")

    advance = finish = begin

    def warmup(self, buckets: tuple[int, ...] | None = None) -> None:
        pass

    def drop_jobs(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {"batches": self.batches}
