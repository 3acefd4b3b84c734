"""The Triton kernel variants an AR decoder stage launches, listed before its build as
KernelJobs (engine/kernels_ahead.py compiles them in processes of their own while the stages
load; a stage builder lists them through StageBuilder.kernels_ahead).

NOTE (why): on a cold start the 7B Qwen2.5-Omni thinker's and talker's warm-ups compiled ~10 s
of these kernels on their first launches, one after another (H200, py-spy: GEMVs 4.8 s, paged
prefill attention 2.5 s, paged decode attention 1.5 s, the sampler 1.2 s, rope + KV write
0.3 s). Which variants they compile follows from the decoder's dims, its dtype, the stage's
EngineConfig, its warm-up's sampling params and two facts of its GPU (the compute capability:
PDL; the SM count: GEMV split-K and decode splits), read here in the stage's process. Each
kernel file's compile_ahead runs the same launch code as its real launch, on TensorSpecs.

No stage registers these yet: on an H200 they did not shorten a cold 7B start as wired
(models/qwen2_5_omni/pipeline.py's note has the numbers); the listers are there and tested
(cache keys equal to the real launches') for when they do.

Left out (the stage compiles them on first use, as without this):
  - tensor-parallel stages (a rank's heads and vocabulary shards; no GEMVs);
  - with fused_rope_kv off: attention and rope (q is then the compiled input kernel's view,
    whose strides are not known before the build);
  - decode attention without decode graphs (eager steps: num_splits follows each step's
    widest block table);
  - weight-only FP8 projections (dense_gemvs=False: their GEMVs take up to 16 rows and FP8
    weights, their prefill GEMMs are layers/moe_triton.py's);
  - logprobs and structured-output steps (captured at first use, not at warm-up).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.engine.ar.cuda_graphs import (decode_input_offsets, graph_batch_sizes,
                                             graphs_enabled)
from omnistage.engine.ar.kernels import KernelOptions
from omnistage.engine.ar.model_runner import warmup_flag_sets
from omnistage.engine.ar.scheduler import EngineConfig
from omnistage.engine.kernels_ahead import KernelJob
from omnistage.sampling_params import SamplingParams


@dataclass(frozen=True)
class DecoderDims:
    """What the kernels of a decoder stage compile for, of its model config."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the sampled logits' width
    attention_bias: bool  # q/k/v biases (o_proj has none)
    mlp_bias: bool = False  # gate/up and down biases

    @classmethod
    def from_config(cls, cfg: Any) -> DecoderDims:
        """From a models.layers.DecoderConfig (or anything with its field names)."""
        return cls(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.attention_bias,
                   cfg.mlp_bias)


@dataclass(frozen=True)
class GpuFacts:
    """What the launch code reads of the device: compute capability (PDL), SM count."""

    capability: tuple[int, int]
    sms: int

    @classmethod
    def of(cls, device: torch.device) -> GpuFacts:
        props = torch.cuda.get_device_properties(device)
        return cls((props.major, props.minor), props.multi_processor_count)


def decode_input_misalignment(max_size: int) -> tuple[int, int]:
    """(block tables, seq_lens) of the decode graphs: their byte offsets past a 16-byte
    boundary (DecodeGraphs' int32 inputs, cuda_graphs.decode_input_offsets). Triton
    specializes pointers on that alignment."""
    off = decode_input_offsets(max_size)
    return 4 * off["tables"] % 16, 4 * off["lens"] % 16


def ar_kernel_jobs(dims: DecoderDims, dtype: torch.dtype, engine: EngineConfig,
                   device: torch.device, warm_params: Iterable[SamplingParams] = (),
                   facts: GpuFacts | None = None, dense_gemvs: bool = True
                   ) -> list[KernelJob]:
    """One KernelJob per distinct Triton compile that an AR engine on a decoder of `dims`
    (weights and KV cache of `dtype`) launches with `engine` on `device`: its warm-up's
    (decode graphs of every batch size, heads for warm_params' sampling flags, prefill graphs)
    and its first steps'. None off CUDA. facts: read of the device when None.
    dense_gemvs: the layers' 16-bit GEMVs (False: weight-only FP8 projections)."""
    if device.type != "cuda" or engine.tensor_parallel_size > 1:
        return []
    facts = facts or GpuFacts.of(device)
    from omnistage.engine.ar import sampler_triton  # triton: CUDA only
    from omnistage.engine.ar import triton_attention as ta
    from omnistage.engine.ar import triton_gemv as tg
    from omnistage.engine.ar import triton_rope_kv as rk
    d, h, kv, hd = dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim
    page = engine.block_size
    max_blocks = -(-engine.max_model_len // page)
    sizes = graph_batch_sizes(engine.max_num_seqs)
    pdl, cap = engine.pdl, facts.capability
    jobs: dict[tuple, KernelJob] = {}

    def add(compile_ahead: Callable[..., Any], *args: Any) -> None:
        # a compile_ahead's arguments tell its variants apart: one job per distinct call
        jobs.setdefault((compile_ahead.__module__, compile_ahead.__name__, *args),
                        KernelJob(compile_ahead, args))

    if engine.fused_rope_kv:  # q [T, H, hd]: rope_write_kv's fresh output
        # GEMVs first: the longest compiles (DecoderLayer.uses_triton_gemv: decode rows up to
        # gemv_max_rows, layers whose four weights all have measured configs)
        weights = [("norm_gemv", (h + 2 * kv) * hd, d, dims.attention_bias),
                   ("gemv_residual", d, h * hd, False),
                   ("norm_gemv_silu_mul", 2 * dims.intermediate_size, d, dims.mlp_bias),
                   ("gemv_residual", d, dims.intermediate_size, dims.mlp_bias)]
        if dense_gemvs and engine.triton_gemv \
                and tg.has_configs([(n, k) for _, n, k, _ in weights], dtype):
            for m in (m for m in sizes if m <= KernelOptions().gemv_max_rows):
                for op, n, k, bias in weights:
                    add(tg.compile_ahead, op, n, k, m, dtype, bias, engine.gemv_fused_reduce,
                        pdl, cap, facts.sms)
        add(ta.compile_ahead_prefill, h, kv, hd, page, dtype, max_blocks)
        if graphs_enabled(engine.cuda_graphs, device):
            tables, lens = decode_input_misalignment(sizes[-1])
            for b in sizes:  # (a graph's block tables: max_blocks wide)
                splits = ta.num_splits_for(b, kv, max_blocks * page, facts.sms)
                add(ta.compile_ahead_decode, h, kv, hd, page, dtype, splits, max_blocks, tables,
                    lens, pdl, cap)
        add(rk.compile_ahead, h, kv, hd, page, dtype, pdl, cap)
    if engine.fast_sampler:
        # the warm-up's head graphs (and greedy, which every warm-up has); modes 0 and 1
        # launch the same finish kernel after prep: listed once
        modes = sorted({0} | {sampler_triton.sampler_mode(f)
                              for f in warmup_flag_sets(list(warm_params))})
        for mode in modes:
            add(sampler_triton.compile_ahead, dims.vocab_size, mode, mode in (modes[0], 2))
    return list(jobs.values())
