"""The interface a model family implements to run on the non-AR engine (`GenStageWorker`).

A family's model object (a `GenModel`) holds no threads, streams or graphs of its own: it says
what work is ready and runs a batch of it; the engine decides what runs together and when, and
provides CUDA graphs, private streams and green contexts (`GraphCache`, graphs.py).

Unit of work: an *output* of a request (an audio chunk, an image, an embedding). A step runs the
next output of up to `max_batch` requests together; requests join and leave between steps. A
request's first output goes ahead of later outputs of other requests. A step of later outputs
may run in parts (`preempt_parts` intervals each) with first outputs between two parts, so the
run is split into begin(batch, beside) -> job, advance(job, n) -> all queued?, finish(job).

The clients this interface is shaped for:
  - Qwen2.5-Omni code2wav (code2wav_stage.py): an output is a chunk of a sliding DiT window;
    the ODE's 9 RK4 intervals are the intervals, then BigVGAN runs in finish(); graphs per
    (batch bucket, window width): the window's preparation and one interval graph replayed
    per interval, so a part replays intervals.
  - Qwen3-Omni code2wav: a stateful streaming decoder (per-layer sliding-window KV and causal
    conv state carried between chunks over 16-codebook frames): the per-request state object
    holds those caches (gathered into the batch in begin(), scattered back in finish()); one
    interval per step (intervals() = 1), shape key = the chunk's frame count.
  - a diffusion image DiT: an output is the image; a request's state holds its latents and its
    timestep; each step runs one denoising step of every batched request at its own timestep
    (step-level batching across requests at different timesteps), CFG as batch doubling inside
    run(); `done()` once its N steps are over (outputs()' payload is empty until then: the
    worker only emits events whose payload is not None).
  - prefill-only text encoders: `streaming = False`: one output per request, computed whole at
    launch (no parts, no launcher thread), its payload the embeddings.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(kw_only=True)
class GenRequest:
    """The engine's bookkeeping on a request; a family's per-request state derives from it."""

    outputs: int = 0  # outputs emitted so far (0: its first output is next)
    in_job: bool = False  # its next output is in the step run in parts (the worker's job)
    # set by the worker at submit: add_input runs holding it, and a step that takes this
    # request's input (on the launcher thread, while more input may arrive) holds it too
    input_lock: Any = field(default=None, repr=False, compare=False)

    def inputs_held(self) -> Any:
        """A context holding input_lock (a no-op outside a worker)."""
        return self.input_lock if self.input_lock is not None else nullcontext()


class GenModel(Protocol):
    """What a family implements (host logic unless it says it queues GPU work).

    streaming: False = each request has one output, computed whole at launch on the calling
    thread (results on the host at once); True = outputs are queued on the GPU (launch), read
    at collect, and later-output steps may run in parts.
    """

    streaming: bool

    def new_state(self, request: Any) -> GenRequest:
        """The per-request state of a submitted request (runs on the runtime's thread: it may
        move tensors to the device)."""

    def add_input(self, state: GenRequest, data: Any, finished: bool) -> None:
        """Input from the upstream stage (codes); finished: the last input came."""

    def ready(self, state: GenRequest) -> bool:
        """Its next output can run now (or its input ended with nothing to compute)."""

    def empty(self, state: GenRequest) -> bool:
        """Its input ended with nothing to compute: it finishes without an output."""

    def input_pending(self, state: GenRequest) -> bool:
        """More input still comes (an upstream stage runs beside: steps run `beside` it)."""

    def done(self, state: GenRequest) -> bool:
        """After an output (state.outputs counts it): whether that was its last one."""

    def batch_key(self, state: GenRequest) -> Hashable:
        """Requests batch together only with equal keys (e.g. an image size: one resolution
        per batch); the oldest ready request's key picks a step's batch."""

    def batch_rows(self, state: GenRequest) -> int:
        """The rows this request adds to a step (max_batch bounds their sum; a request with more
        runs alone): 1, or e.g. images x 2 for CFG."""

    def is_held(self, batch: Sequence[GenRequest]) -> bool:
        """Running this batch now needs a graphed shape that the unfinished job holds."""

    def intervals(self, batch: Sequence[GenRequest]) -> int:
        """How many intervals a step of this batch has (parts are preempt_parts of them)."""

    def run(self, batch: Sequence[GenRequest]) -> Any:
        """Queue a whole step (on the current stream); returns what outputs() reads."""

    def begin(self, batch: Sequence[GenRequest], beside: bool) -> Any:
        """A step to run in parts (a job); beside: other stages run beside it (free SMs)."""

    def advance(self, job: Any, intervals: int) -> bool:
        """Queue up to `intervals` more of the job's intervals; True once all are queued."""

    def finish(self, job: Any) -> Any:
        """Queue the job's end (after advance returned True); returns what outputs() reads."""

    def outputs(self, result: Any) -> list[dict[str, Any] | None]:
        """Once the GPU is done: each batch row's StageEvent fields (e.g. {"audio": wav}), in
        batch order; None: no event for that row this step."""

    def warmup(self, buckets: tuple[int, ...] | None = None) -> None:
        """Capture the graphs of these batch buckets (default: all) now.

        Lazy capture (optional, GenEngineConfig.warmup_plan="lazy"): a model that also has
        `warmup(buckets, lazy=True)` (capture only what first requests need now, queue the
        rest), `pending_captures() -> int` and `capture_next()` (capture one queued graph; on
        the stage's own thread, between steps) gets its queued graphs captured one per idle
        gap of the worker."""

    def drop_jobs(self) -> None:
        """Forget unfinished jobs (their stage failed): their shapes serve steps again."""

    def stats(self) -> dict[str, float]:
        """The model's (graph) statistics, merged into the worker's."""
