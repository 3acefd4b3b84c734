"""OmniLLM: the offline Python API (blocking), on the same runtime as AsyncOmniLLM."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from omnistage.entrypoints.base import OmniBase
from omnistage.outputs import OmniRequestOutput


class OmniLLM(OmniBase):
    """generate() validates every prompt and parameter before any work starts (ValueError naming
    the prompt index and field); errors that only appear while running come back in that
    request's `error`, and the other requests finish. The runtime loop runs in the caller's
    thread during generate()."""

    background_runtime = False

    def generate(self, prompts: Any, sampling_params: Any = None,
                 output_modalities: list[str] | None = None,
                 use_tqdm: bool = True) -> list[OmniRequestOutput]:
        prompts = prompts if isinstance(prompts, list) else [prompts]
        if not prompts:
            raise ValueError("prompts: empty list")
        reqs = self._prepare(prompts, sampling_params, output_modalities)
        results: dict[str, OmniRequestOutput] = {}
        # image pipelines: the bar counts denoising steps (of every request), from their
        # progress outputs; otherwise finished requests
        steps = {r.request_id: 0 for r in reqs if r.progress_total is not None}
        total = sum(r.progress_total for r in reqs) if steps else len(reqs)
        bar = tqdm(total=total, desc="denoising steps" if steps else "generate",
                   disable=not use_tqdm)

        def sink(out: OmniRequestOutput) -> None:
            if out.request_id in steps and out.progress is not None:
                bar.update(out.progress[0] - steps[out.request_id])
                steps[out.request_id] = out.progress[0]
            if out.finished:
                results[out.request_id] = out
                if not steps:
                    bar.update(1)

        for req in reqs:
            self.runtime.submit(req, sink, stream=req.request_id in steps)
        self.runtime.run_until(lambda: len(results) == len(reqs))
        bar.close()
        outs = [results[r.request_id] for r in reqs]
        for r, out in zip(reqs, outs):  # offline results carry the whole utterance
            if r.audio_stage is not None and r.audio_stage in out.stages:
                out.audio = out.stages[r.audio_stage].audio
        return outs
