"""What every diffusion image family shares: a diffusers pipeline folder (model_index.json +
component folders) served as three stages on the non-AR engine (engine/gen/diffusion.py):

    text_encoder (one-shot, batched; identical prompts in a batch encoded once)
      -> dit (denoising, step-level batching across requests, CFG as batch doubling)
      -> vae (one-shot decode, batched per size) -> images

A family subclasses `ImagePipeline` with its facts (prompt template, noise layout, timestep
convention, defaults) and registers three stage builders; the batching, CFG, Euler update and
hand-offs are the engine's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omnistage.checkpoint import read_json
from omnistage.config.schema import PipelineConfig
from omnistage.engine.gen import GenEngineConfig, GenStageWorker
from omnistage.engine.gen.diffusion import DenoiseRequest, Denoiser, OneShot, pad_rows
from omnistage.engine.gen.flow_match import FlowMatchSchedule
from omnistage.models.registry import register_adapter
from omnistage.runtime.build import StageContext, build_model, build_stages, new_request_id
from omnistage.runtime.orchestrator import RuntimeRequest
from omnistage.runtime.stage import StageEvent, StageLink
from omnistage.sampling_params import DiffusionParams, SamplingParams

MAX_IMAGES = 8  # per prompt (n): with CFG its rows double, within the denoiser's max_batch
MEGAPIXEL = 1024 * 1024  # a denoiser row's unit: an image of up to this many pixels counts 1
DENOISE_MAX_ROWS = 16
DECODE_MAX_ROWS = 8
DECODE_PIXELS = 2 * 1024 * 1024  # per VAE call (a 1024x1024 decode peaks at ~5 GB)
MAX_STEPS = 200
MAX_PROMPT_CHARS = 1 << 16


@register_adapter("payload")
class PayloadLink:
    """Hands an upstream event's payload (embeddings, latents) to the downstream stage whole."""

    def send(self, ev: StageEvent, upstream: Any) -> Any | None:
        return ev.payload

    def receive(self, request_id: str, msg: Any, downstream: Any) -> None:
        downstream.add_input(request_id, msg, True)


@dataclass
class EncodeRequest:
    """A text-encoder stage request: the prompt's ids, and the negative prompt's when CFG runs."""

    ids: list[int]
    negative_ids: list[int] | None = None


def component_path(ctx: StageContext, component: str) -> Path:
    return ctx.path / component


def load_component(cls: type, ctx: StageContext, component: str, *args: Any) -> Any:
    """A diffusers component folder's module (config.json + safetensors) on the stage's device,
    or seeded random weights with load_format="dummy"."""
    from omnistage.checkpoint import dummy_tensors, iter_tensors, load_parameters
    folder = component_path(ctx, component)
    config = read_json(folder / "config.json")
    if ctx.options.get("load_format") != "dummy":
        return build_model(lambda cfg: cls(cfg, *args), config, iter_tensors(folder),
                           ctx.device, ctx.dtype)
    # random weights by our own parameter names (load_weights takes diffusers' names)
    model = build_model(lambda cfg: _Unloaded(cls(cfg, *args)), config, [], ctx.device,
                        ctx.dtype).module
    load_parameters(model, dummy_tensors(model))
    return model


class _Unloaded(torch.nn.Module):
    """A module built by build_model without weights (load_format="dummy" fills them)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def load_weights(self, tensors: Any) -> None:
        pass


def encoder_worker(ctx: StageContext, encode: Any, drop: int = 0) -> GenStageWorker:
    """The text-encoder stage: `encode(ids [B, T], mask [B, T]) -> [B, T, D]`; each unique id
    sequence of a batch is encoded once; a prompt's embeddings are its rows from `drop` on."""

    def run(requests: list[EncodeRequest]) -> list[dict[str, Any]]:
        unique = {tuple(ids): None for r in requests
                  for ids in (r.ids, r.negative_ids) if ids is not None}
        seqs = list(unique)
        ids, _ = pad_rows([torch.tensor(s)[:, None] for s in seqs], torch.long)
        with torch.inference_mode():  # causal and right-padded: real rows need no mask
            hidden = encode(ids[:, :, 0].to(ctx.device), None)
        rows = {s: hidden[i, drop:len(s)] for i, s in enumerate(seqs)}
        return [{"payload": {"text": rows[tuple(r.ids)],
                             "negative": None if r.negative_ids is None
                             else rows[tuple(r.negative_ids)]}} for r in requests]

    return GenStageWorker(ctx.name, OneShot(run, needs_input=False, module=encode), ctx.device,
                          GenEngineConfig(max_batch=DENOISE_MAX_ROWS, first_output_alone=False))


class DiTNetwork:
    """A family's DiT as the engine's DiffusionTransformer (engine/gen/diffusion.py): the
    forward, its first-block split and compile go to the module (which takes `dit_inputs`'
    arguments); `sign` flips a model that predicts the negated velocity. A family gives
    dit_inputs, guide and example."""

    sign = 1.0

    def __init__(self, dit: torch.nn.Module) -> None:
        self.dit = dit

    def dit_inputs(self, latents: Tensor, timesteps: Tensor, text: Tensor,
                   text_mask: Tensor | None, grid: tuple[int, ...]) -> tuple:
        """The module's arguments for the scheduler's t (0..1000) (its own time convention)."""
        raise NotImplementedError

    @torch.inference_mode()
    def predict(self, *args: Any) -> Tensor:
        out = self.dit(*self.dit_inputs(*args))
        return out if self.sign > 0 else -out

    @torch.inference_mode()
    def first(self, *args: Any) -> tuple[Any, Tensor]:
        return self.dit.first(*self.dit_inputs(*args))

    @torch.inference_mode()
    def rest(self, state: Any, rows: Tensor | None) -> Tensor:
        return self.dit.rest(state, rows)

    @torch.inference_mode()
    def finish(self, state: Any, residual: Tensor) -> Tensor:
        out = self.dit.finish(state, residual)
        return out if self.sign > 0 else -out

    def compile(self) -> None:
        self.dit.compile_blocks()


def example_mask(rows: int, text_len: int, padded: bool, device: torch.device) -> Tensor | None:
    """A warm-up text mask: row i holds text_len - i real tokens (None: unpadded)."""
    if not padded:
        return None
    return torch.arange(text_len, device=device)[None] < (text_len - torch.arange(
        rows, device=device))[:, None]


def denoiser_worker(ctx: StageContext, network: Any) -> GenStageWorker:
    """The denoising stage; on CUDA its blocks are compiled and warmed up while it is built
    (constructor keyword `dit_compile=False`: eager); `step_cache=0.1` turns the first-block
    cache on at that threshold (engine/gen/diffusion.py Denoiser; off by default)."""
    compile_blocks = ctx.options.get("dit_compile")
    compile_blocks = ctx.device.type == "cuda" if compile_blocks is None else compile_blocks
    denoiser = Denoiser(network, ctx.device, ctx.dtype, compile=compile_blocks,
                        step_cache=ctx.options.get("step_cache"))
    return GenStageWorker(ctx.name, denoiser, ctx.device,
                          GenEngineConfig(max_batch=DENOISE_MAX_ROWS, first_output_alone=False,
                                          preempt_parts=0, warmup=compile_blocks))


def to_uint8(images: Tensor) -> list[np.ndarray]:
    """[B, 3, H, W] in [-1, 1] -> uint8 [H, W, 3] per image, rounded as diffusers does."""
    x = (images.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return list((x * 255).round().astype(np.uint8))


def decoder_worker(ctx: StageContext, decode: Any, module: torch.nn.Module) -> GenStageWorker:
    """The VAE stage: `decode(latents [B, ...], grid) -> [B, 3, H, W]` in [-1, 1] over a batch
    of requests' (latents, grid) of one shape."""

    def run(inputs: list[tuple[Tensor, tuple]]) -> list[dict[str, Any]]:
        latents = torch.cat([lat for lat, _ in inputs]).to(ctx.dtype)
        per_call = max(1, DECODE_PIXELS // pixels(inputs[0]))
        images = []
        with torch.inference_mode():  # in calls of at most DECODE_PIXELS (activation memory)
            for chunk in latents.split(per_call):
                images += to_uint8(decode(chunk, inputs[0][1]))
        out, at = [], 0
        for lat, _ in inputs:
            out.append({"images": images[at:at + len(lat)]})
            at += len(lat)
        return out

    def pixels(item: tuple[Tensor, tuple]) -> int:  # of one image: 8x the latent's side
        return 64 * item[0].shape[-1] * item[0].shape[-2] if item[0].dim() == 4 else \
            256 * item[0].shape[1]  # (packed 2x2 tokens)

    return GenStageWorker(ctx.name, OneShot(run, needs_input=True,
                                            key=lambda item: (item[1], *item[0].shape[1:]),
                                            rows=lambda item: item[0].shape[0],
                                            module=module),
                          ctx.device, GenEngineConfig(max_batch=DECODE_MAX_ROWS,
                                                      first_output_alone=False))


class ImagePipeline:
    """The Pipeline protocol (runtime/pipeline.py) for diffusers text-to-image folders."""

    builtin: str
    CLASS_NAMES: tuple[str, ...] = ()
    family = "image"
    warmup_plan_options: tuple[str, ...] = ()  # (Pipeline) no lazy warm-up
    size_multiple = 16  # VAE 8x, then 2x2 patches
    max_side = 2048
    max_pixels = 2048 * 2048
    default_steps = 50
    max_sequence_length = 512

    @classmethod
    def matches(cls, config: dict) -> bool:
        return config.get("_class_name") in cls.CLASS_NAMES

    def __init__(self, path, config: dict, pipeline: PipelineConfig, device: torch.device,
                 dtype: torch.dtype, engine_options: dict[str, Any]) -> None:
        from omnistage.runtime.build import pop_load_options
        options = dict(engine_options)
        load = pop_load_options(options)
        dit_compile = options.pop("dit_compile", None)
        if dit_compile not in (None, True, False):
            raise ValueError(f"dit_compile: true, false or None (on for CUDA), got "
                             f"{dit_compile!r}")
        step_cache = options.pop("step_cache", None)
        if step_cache is not None and (isinstance(step_cache, bool) or not isinstance(
                step_cache, (int, float)) or not 0 < step_cache <= 1):
            raise ValueError(f"step_cache: a threshold in (0, 1] or None (off), got "
                             f"{step_cache!r}")
        if options:
            raise ValueError(f"engine options: {sorted(options)} do not apply to {self.family} "
                             "(an image pipeline takes device, dtype, load_format, dit_compile, "
                             "step_cache)")
        self.path, self.config, self.model_index = Path(path), pipeline, config
        if [s.kind for s in pipeline.stages] != ["gen", "gen", "gen"]:
            raise ValueError(f"pipeline: {self.family} runs three gen stages (text encoder, "
                             "denoiser, decoder)")
        self.schedule = FlowMatchSchedule.from_config(
            read_json(self.path / "scheduler" / "scheduler_config.json"))
        # AutoTokenizer's choice, without importing it where the folder settles it
        from omnistage.tokenizer_loader import load_tokenizer
        self.tokenizer = load_tokenizer(self.path / "tokenizer")
        self.output_modalities = ["image"]
        self.default_params: dict[str, SamplingParams] = {}
        self.voices: dict[str, Any] = {}
        self.max_model_len = self.max_sequence_length
        self.workers, self.process_stages = build_stages(
            path, config, pipeline, pipeline.stages, device, dtype,
            {**load, "dit_compile": dit_compile, "step_cache": step_cache,
             "stage_worker": None})
        if device.type == "cuda":
            self._warm_up()

    def _warm_up(self) -> None:
        """One encode and one decode at the default size now (cuDNN picks its convolution
        algorithms on a shape's first call: the first request would pay for it)."""
        te, _, vae = self.stage_names
        p = DiffusionParams()
        latents, grid = self.noise(1, p.height, p.width, 0)
        self.workers[te].model.run_batch([EncodeRequest(self.prompt_ids("warm-up"))])
        self.workers[vae].model.run_batch([(latents.to(self.workers[vae].device), grid)])

    @property
    def stage_names(self) -> list[str]:
        return self.config.stage_names

    @classmethod
    def build_stage(cls, path: Path, config: dict, pipeline: PipelineConfig, name: str,
                    device: torch.device, dtype: torch.dtype, options: dict[str, Any]):
        from omnistage.runtime.build import build_stage_worker
        return build_stage_worker(path, config, pipeline, name, device, dtype, options)

    # ------------------------------------------------------------ family hooks
    def prompt_ids(self, text: str) -> list[int]:
        """The encoder's ids of one prompt (template, truncation)."""
        raise NotImplementedError

    def noise(self, n: int, height: int, width: int, seed: int) -> tuple[Tensor, tuple]:
        """(n images' initial latents, fp32 CPU, drawn as diffusers does; the grid key)."""
        raise NotImplementedError

    def guidance(self, p: DiffusionParams, sigmas: list[float], steps: int
                 ) -> tuple[list[float], dict[str, Any], bool]:
        """(the CFG scale per step, the guide options, whether a negative prompt is encoded)."""
        raise NotImplementedError

    def image_seq_len(self, height: int, width: int) -> int:
        return (height // 16) * (width // 16)

    # ------------------------------------------------------------ requests
    def prepare(self, prompt: Any, params: dict[str, Any], modalities: list[str], where: str,
                index: int) -> RuntimeRequest:
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(prompt, dict) and set(prompt) - {"prompt"}:
            raise ValueError(f"{where}: an image pipeline takes a text prompt only (a string or "
                             f"{{'prompt': str}}); got keys {sorted(prompt)}")
        if not isinstance(text, str) or not text or len(text) > MAX_PROMPT_CHARS:
            raise ValueError(f"{where}.prompt: a non-empty string of at most "
                             f"{MAX_PROMPT_CHARS} characters")
        p = params.get(self.stage_names[0]) or DiffusionParams()
        if not isinstance(p, DiffusionParams):
            raise ValueError(f"sampling_params: {self.family} takes DiffusionParams, got "
                             f"{type(p).__name__}")
        p.validate("sampling_params", multiple=self.size_multiple, max_pixels=self.max_pixels,
                   max_side=self.max_side, max_steps=MAX_STEPS, max_images=MAX_IMAGES)
        if p.num_images * p.height * p.width > MAX_IMAGES * MEGAPIXEL:
            raise ValueError(f"sampling_params.num_images: {p.num_images} images of "
                             f"{p.width}x{p.height} exceed {MAX_IMAGES} megapixels per request")
        steps = p.num_inference_steps or self.default_steps
        seed = p.seed if p.seed is not None else int(np.random.randint(0, 2**63 - 1))
        sigmas, timesteps = self.schedule.sigmas(steps, self.image_seq_len(p.height, p.width))
        guidance, options, negative = self.guidance(p, sigmas, steps)
        noise, grid = self.noise(p.num_images, p.height, p.width, seed)
        encode = EncodeRequest(self.prompt_ids(text),
                               self.prompt_ids(p.negative_prompt or "") if negative else None)
        te, dit, vae = self.stage_names
        return RuntimeRequest(
            request_id=new_request_id(index), path=[te, dit, vae],
            stage_requests={te: encode, dit: DenoiseRequest(
                noise, sigmas, timesteps, guidance, grid, -(-p.height * p.width // MEGAPIXEL),
                options), vae: None},
            text_stage=te, image_stage=vae, seed=seed, progress_total=steps,
            links=[StageLink(te, dit, PayloadLink()), StageLink(dit, vae, PayloadLink())])
