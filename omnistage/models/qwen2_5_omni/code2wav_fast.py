"""Qwen2.5-Omni code2wav: the DiT's whole ODE as one fixed-shape function (CUDA-graph capturable).

`Qwen2_5OmniFastDiT.sample` integrates the flow for a padded batch of frame windows with the
arithmetic of `Qwen2_5OmniToken2WavDiT.sample`, but with everything that does not depend on the
ODE state hoisted out of the 36 evaluations:
  - the time embedding and every layer's AdaLN modulation depend only on t, and the time grid is
    fixed, so they form a table [evals, layers, 6, D] computed once here (no per-evaluation GEMV
    over the 22 x 1024 x 6144 modulation weights);
  - the input projection is split into a mel part (per evaluation) and a static part (codes,
    speaker, cond: once per window); rotary angles and attention masks are built once per window;
  - q, k and v are one GEMM; on CUDA the attention is one Triton kernel that visits only the
    blocks a layer's mask lets each query see (dit_attention_triton.py), and the first feed-forward
    GEMM applies its GELU in the GEMM's epilogue (cuBLASLt, via torch._addmm_activation).
It reads its inputs only from tensors and does no host synchronisation, so one call can be
captured in a CUDA graph (DiTGraph: one interval graph serves all the intervals, its time step
loaded into an IntervalCursor). The ODE state stays float32 whatever the DiT's compute dtype.
The DiT runs as three pure step functions (input, layer, output; see the NOTE below them), run
eagerly or, with `compiled=True`, through torch.compile (inductor; shapes: _compiled_steps) so
that the norms, modulation, rotary, activations and residuals fuse around the GEMMs and attention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from omnistage.engine.gen.graphs import SegmentGraph

from .code2wav_options import DIT_ATTENTIONS as ATTENTIONS
from .token2wav_dit import Qwen2_5OmniToken2WavDiT, qwen2_5_omni_dit_attention_mask



@functools.cache
def _block_kernels() -> ModuleType | None:
    """dit_attention_triton (registers torch.ops.omnistage.dit_block_attention), or None where
    triton is missing (CPU-only installs: SDPA only)."""
    try:
        from . import dit_attention_triton
    except ImportError:
        return None
    return dit_attention_triton


def ode_times(num_steps: int, sway_coefficient: float | None) -> tuple[list[float], list[float]]:
    """(evaluation times [4 (num_steps - 1)], interval widths [num_steps - 1]) as float32 values.

    NOTE: computed with the same float32 tensor ops as `Qwen2_5OmniToken2WavDiT.sample` (RK4 3/8
    rule: t0, t0 + h/3, t0 + 2h/3, t1 per interval), so the times are bit-identical to it.
    """
    grid = torch.linspace(0, 1, num_steps, dtype=torch.float32)
    if sway_coefficient is not None:
        grid = grid + sway_coefficient * (torch.cos(torch.pi / 2 * grid) - 1 + grid)
    times, widths = [], []
    for t0, t1 in zip(grid[:-1], grid[1:], strict=True):
        h = t1 - t0
        times += [float(t0), float(t0 + h * (1 / 3)), float(t0 + h * (2 / 3)), float(t1)]
        widths.append(float(h))
    return times, widths


class Qwen2_5OmniFastDiT:
    """Prepared DiT weights + time table for one ODE schedule and one compute dtype.

    NOTE: a snapshot of the weights at construction (fp32 tensors other than q/k/v are shared
    with the module, not copied); build it after loading the checkpoint.
    """

    @torch.no_grad()
    def __init__(self, dit: Qwen2_5OmniToken2WavDiT, dtype: torch.dtype = torch.float32,
                 num_steps: int = 10, guidance_scale: float = 0.5,
                 sway_coefficient: float | None = -1.0, attention: str | None = None) -> None:
        """attention: "block" (the Triton kernel: CUDA, or CPU under TRITON_INTERPRET=1) or
        "sdpa"; None = "block" on CUDA where triton is usable, else "sdpa"."""
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dit_dtype: float32, bfloat16 or float16, got {dtype}")
        if int(num_steps) < 2:
            raise ValueError(f"num_steps: must be >= 2, got {num_steps}")
        spec, self.dtype = dit.spec, dtype
        self.spec, self.guidance = spec, float(guidance_scale)
        self.use_cfg = self.guidance >= 1e-5
        self.times, self.widths = ode_times(int(num_steps), sway_coefficient)
        p = next(dit.parameters())
        self.device, mdt = p.device, p.dtype
        kernels = _block_kernels() if attention != "sdpa" else None
        usable = kernels is not None and kernels.supported(spec.head_dim)
        if attention is None:
            attention = "block" if p.is_cuda and usable else "sdpa"
        if attention not in ATTENTIONS:
            raise ValueError(f"attention: one of {ATTENTIONS}, got {attention!r}")
        if attention == "block" and not usable:
            raise ValueError(f"attention: 'block' needs triton and a head_dim that is a power of "
                             f"two >= 16 (head_dim {spec.head_dim}, triton "
                             f"{'found' if kernels is not None else 'missing'})")
        self.attention = attention
        # the block kernel's block size; 0 selects SDPA in _dit_layer
        self.block_frames = spec.block_size if attention == "block" else 0

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(dtype).contiguous()

        # time table: every layer's modulation at every evaluation time, (1 + scale) pre-added
        t = torch.tensor(self.times, device=self.device, dtype=mdt)
        temb = F.silu(dit.time_embed(t))  # [E, D]
        self.mods, self.layers = [], []
        for layer in dit.transformer_blocks:
            m = layer.attn_norm.linear(temb).view(len(self.times), 6, -1)
            m = torch.stack([m[:, 0], 1 + m[:, 1], m[:, 2], m[:, 3], 1 + m[:, 4], m[:, 5]], 1)
            self.mods.append(cast(m))  # [E, 6, D]: shift, 1+scale, gate, shift, 1+scale, gate
            a, ff = layer.attn, layer.ff.ff
            self.layers.append((
                cast(torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight])),
                cast(torch.cat([a.to_q.bias, a.to_k.bias, a.to_v.bias])),
                cast(a.to_out[0].weight), cast(a.to_out[0].bias), cast(ff[0].weight),
                cast(ff[0].bias), cast(ff[3].weight), cast(ff[3].bias),
                (layer.look_backward, layer.look_ahead)))
        m = dit.norm_out.linear(temb).view(len(self.times), 2, -1)
        self.out_mods = cast(torch.stack([1 + m[:, 0], m[:, 1]], 1))  # [E, 2, D]: 1+scale, shift
        self.proj_out = (cast(dit.proj_out.weight), cast(dit.proj_out.bias))
        # the same table by interval (IntervalCursor): row i = every layer's modulation at
        # evaluations 4i .. 4i + 3, then the output norm's; the step widths beside it (float32:
        # the ODE state's arithmetic)
        n_int, n_layers, dim = len(self.widths), len(self.mods), self.out_mods.shape[-1]
        by_layer = torch.stack(self.mods).view(n_layers, n_int, 4, 6, dim).transpose(0, 1)
        self.interval_table = torch.cat([by_layer.reshape(n_int, -1),
                                         self.out_mods.view(n_int, -1)], 1).contiguous()
        self.interval_widths = torch.tensor(self.widths, dtype=torch.float32, device=self.device)
        w = dit.input_embed.proj.weight
        self.w_in_x = cast(w[:, :spec.mel_dim])
        # the static part stays in the model's dtype: it runs once per window
        self.w_in_static = w[:, spec.mel_dim:].detach().contiguous()
        self.b_in = dit.input_embed.proj.bias.detach()
        self.codec_embed = dit.text_embed.codec_embed.weight.detach()
        self.inv_freq = dit.inv_freq
        self.heads, self.head_dim = spec.num_attention_heads, spec.head_dim

    def static_projection(self, codes: torch.Tensor, spk: torch.Tensor, cond: torch.Tensor
                          ) -> torch.Tensor:
        """The input projection's static part + bias: [R * rows, W, D] in the compute dtype.

        codes [R, W / repeats] long; spk [R, 2, enc_dim] (speaker encoder on ref_mel, on zeros);
        cond [R, enc_emb_dim]. Rows: conditioned (all R), then unconditioned with CFG.
        """
        r, w = codes.shape[0], codes.shape[1] * self.spec.repeats
        emb = F.embedding(codes, self.codec_embed).repeat_interleave(self.spec.repeats, dim=1)
        enc, cnd = spk[:, 0], cond
        if self.use_cfg:  # the null row: codes 0, speaker encoding of zeros, cond 0
            emb = torch.cat([emb, self.codec_embed[0].expand(r, w, -1)])
            enc, cnd = torch.cat([enc, spk[:, 1]]), torch.cat([cond, torch.zeros_like(cond)])
        static = torch.cat([enc[:, None].expand(-1, w, -1), emb, cnd[:, None].expand(-1, w, -1)],
                           dim=-1)
        return F.linear(static, self.w_in_static, self.b_in).to(self.dtype)

    def window_geometry(self, start: torch.Tensor, nvalid: torch.Tensor, width: int
                        ) -> tuple[tuple[torch.Tensor, torch.Tensor], dict, torch.Tensor]:
        """start/nvalid [R] long -> (rope cos/sin [rows R, 1, W, hd/2], masks by
        (look_backward, look_ahead), valid [R, W]). The masks: SDPA's additive [rows R, 1, W, W];
        the block kernel's frame tables [rows R, 4] (dit_attention_triton.frame_table)."""
        rows = 2 if self.use_cfg else 1
        pos = start[:, None] + torch.arange(width, device=start.device)
        valid = torch.arange(width, device=start.device) < nvalid[:, None]
        pos2, valid2 = pos.repeat(rows, 1), valid.repeat(rows, 1)
        angles = pos2[:, None, :, None].float() * self.inv_freq
        rope = (angles.cos().to(self.dtype), angles.sin().to(self.dtype))
        masks = {}
        for *_, key in self.layers:
            if key in masks:
                continue
            if self.block_frames:
                masks[key] = _block_kernels().frame_table(start.repeat(rows), nvalid.repeat(rows),
                                                          *key)
            else:
                allowed = qwen2_5_omni_dit_attention_mask(pos2, valid2, self.spec.block_size, *key)
                # rows padded to 16 elements: the fused attention kernels want aligned strides
                m = torch.zeros(*allowed.shape[:-1], -(-width // 16) * 16, device=start.device,
                                dtype=self.dtype)[..., :width]
                masks[key] = m.masked_fill_(~allowed, float("-inf"))
        return rope, masks, valid

    def velocity(self, x: torch.Tensor, e: int, static: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], masks: dict, keep: torch.Tensor,
                 compiled: bool = False, table: tuple[list[torch.Tensor], torch.Tensor] | None
                 = None) -> torch.Tensor:
        """The guided velocity at evaluation e: ODE state x [R, W, mel] float32 -> [R, W, mel]
        float32 (padding zeroed). compiled: the inductor-compiled step functions (same math).
        table: (every layer's modulation [E, 6, D], the output norm's [E, 2, D]) to index by e
        (None: the whole time table; an IntervalCursor's: one interval's four evaluations)."""
        embed, layer, out = _compiled_steps() if compiled else (_dit_in, _dit_layer, _dit_out)
        layer_mods, out_mods = table or (self.mods, self.out_mods)
        first = layer_mods[0][e]
        h, n = embed(x, static, self.w_in_x, first[0], first[1], self.use_cfg)
        nxt = [(m[e][0], m[e][1]) for m in layer_mods[1:]]  # the next layer's shift, 1 + scale
        nxt.append((out_mods[e][1], out_mods[e][0]))  # then the output norm's
        for mods, (*weights, key), (shift, scale) in zip(layer_mods, self.layers, nxt,
                                                        strict=True):
            h, n = layer(h, n, mods[e], shift, scale, *weights, *rope, masks[key], self.heads,
                         self.block_frames)
        return out(n, *self.proj_out, keep, self.guidance, self.use_cfg)

    def sample(self, noise: torch.Tensor, codes: torch.Tensor, spk: torch.Tensor,
               cond: torch.Tensor, start: torch.Tensor, nvalid: torch.Tensor,
               compiled: bool = False) -> torch.Tensor:
        """The whole ODE for R padded windows: -> mel [R, W, mel] float32 (padding zeroed).

        noise [R, W, mel] float32; codes [R, W / repeats] long; spk [R, 2, enc_dim];
        cond [R, enc_emb_dim]; start [R] long (absolute frame of index 0); nvalid [R] long
        (frames [0, nvalid) are real). Row r equals its window decoded alone, unpadded.
        compiled: run the DiT through the inductor-compiled step functions (see _compiled_steps
        on which new shapes recompile).
        """
        state = self.begin(noise, codes, spk, cond, start, nvalid)
        for i in range(len(self.widths)):
            self.interval(state, i, compiled)
        return state.x

    def compile_for(self, noise: torch.Tensor, codes: torch.Tensor, spk: torch.Tensor,
                    cond: torch.Tensor, start: torch.Tensor, nvalid: torch.Tensor) -> None:
        """Compile the step functions for sample's input shapes (or find them compiled): one
        evaluation, not the 36 of the whole ODE."""
        state = self.begin(noise, codes, spk, cond, start, nvalid)
        self.velocity(state.x, 0, state.static, state.rope, state.masks, state.keep, True)

    def begin(self, noise: torch.Tensor, codes: torch.Tensor, spk: torch.Tensor,
              cond: torch.Tensor, start: torch.Tensor, nvalid: torch.Tensor) -> DiTState:
        """The ODE's state before its first interval (sample's arguments)."""
        width = noise.shape[1]
        static = self.static_projection(codes, spk, cond)
        rope, masks, valid = self.window_geometry(start, nvalid, width)
        keep = valid.unsqueeze(-1)
        return DiTState(noise.masked_fill(~keep, 0.0), static, rope, masks, keep)

    def interval(self, state: DiTState, i: int, compiled: bool = False,
                 cursor: IntervalCursor | None = None) -> torch.Tensor:
        """RK4 interval i (evaluations 4i .. 4i + 3): state.x advanced in place (a CUDA graph
        of one interval writes the same buffer every replay); returns it. cursor: the interval
        whose inputs the cursor holds (i unused): one graph then runs every interval."""
        if cursor is None:
            table, e0, h = None, 4 * i, self.widths[i]
        else:  # (h: a float32 tensor; the same float32 products as the Python float's)
            table, e0, h = (cursor.layer_mods, cursor.out_mods), 0, cursor.width

        def vel(x: torch.Tensor, j: int) -> torch.Tensor:
            return self.velocity(x, e0 + j, state.static, state.rope, state.masks,
                                 state.keep, compiled, table)

        x, third = state.x, 1 / 3
        # the reference's arithmetic, operand order included
        k1 = vel(x, 0)
        k2 = vel(x + k1 * h * third, 1)
        k3 = vel(x + h * (k2 - k1 * third), 2)
        k4 = vel(x + h * (k1 - k2 + k3), 3)
        return state.x.copy_(x + (k1 + 3 * (k2 + k3) + k4) * h / 8)


@dataclass
class DiTState:
    """An ODE in progress: x [R, W, mel] float32 and what every evaluation reads."""

    x: torch.Tensor
    static: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    masks: dict
    keep: torch.Tensor


class IntervalCursor:
    """One RK4 interval's time-dependent inputs in buffers of their own: every layer's
    modulation at its four evaluations, the output norm's and the step width. An interval run
    with the cursor (Qwen2_5OmniFastDiT.interval) reads only these, so one CUDA graph of it
    runs interval i after load(i), and a DiT shape's captures do not grow with the intervals
    (code2wav_graphs.DiTGraph). A graph needs a cursor of its own (graphs of two shapes may
    replay side by side)."""

    def __init__(self, fast: Qwen2_5OmniFastDiT) -> None:
        self.fast = fast
        self.intervals = len(fast.widths)
        n_layers, dim = len(fast.mods), fast.out_mods.shape[-1]
        per_layer = 4 * 6 * dim
        # inference tensors exactly where the time table's are: dynamo guards on it, so the
        # interval graphs then run the code compile_for compiled from the table (else each
        # step function compiled once more for the cursor's kind of tensor)
        with torch.inference_mode(fast.out_mods.is_inference()):
            self.params = torch.empty_like(fast.interval_table[0])
            self.width = torch.empty(1, dtype=torch.float32, device=fast.device)
            self.layer_mods = [self.params[k * per_layer:(k + 1) * per_layer].view(4, 6, dim)
                               for k in range(n_layers)]
            self.out_mods = self.params[n_layers * per_layer:].view(4, 2, dim)

    def load(self, i: int) -> None:
        """Interval i's inputs (two device copies, queued on the current stream)."""
        self.params.copy_(self.fast.interval_table[i], non_blocking=True)
        self.width.copy_(self.fast.interval_widths[i:i + 1], non_blocking=True)


class DiTGraph(SegmentGraph):
    """A DiT shape's graphs: segments[0] prepares the window (g.state); segments[1] and [2]
    are the same RK4 interval (the one whose time step `cursor` holds), captured twice so that
    consecutive intervals alternate between them.

    NOTE: one graph per interval (9 per shape) made the shapes' captures most of a start-up
    (code2wav graphs 35.0 of a 51.9 s warm start on the H200; with these 13.0 of 28.8 s).
    Two copies, so that an interval's launch never waits on its own graph's previous launch;
    c32 with one copy ran at 74.5-76.4 audio-s/s, and with nine graphs at 76.7-81.5 on other
    machines of the same kind: not one A/B, so not settled (benchmarks/results/
    qwen2_5_omni_pipeline_gpu_h200_dit_interval_graphs_session23_issue24_2026-11-29.json)."""

    def __init__(self, inputs: dict[str, torch.Tensor], cursor: IntervalCursor) -> None:
        super().__init__(inputs)
        self.cursor = cursor

    def run_interval(self, i: int) -> None:
        """Queue interval i (the first prepares the window too) on the current stream."""
        if i == 0:
            self.segments[0].replay()
        self.cursor.load(i)
        self.segments[1 + i % 2].replay()

    def replay(self) -> None:
        for i in range(self.cursor.intervals):
            self.run_interval(i)


# ---------------------------------------------------------------- the DiT's step functions
# NOTE: pure functions of tensors, weights passed as arguments: one compiled function serves all
# 22 layers (look-back, look-ahead and plain layers differ only in the mask they are given), so
# compile time is that of one layer per input shape, not of an unrolled 22-layer graph. Each
# layer also applies the next layer's (or the output's) modulated norm, so the residual add
# and the following norm fuse into one kernel across the layer boundary.

def _modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # h [B, W, D]; shift, scale (1 + scale pre-added) [D]
    return torch.addcmul(shift, F.layer_norm(h, h.shape[-1:], eps=1e-6), scale)


def _dit_in(x: torch.Tensor, static: torch.Tensor, w_in_x: torch.Tensor, shift: torch.Tensor,
            scale: torch.Tensor, cfg: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # x [R, W, mel] float32 ODE state; static [B, W, D] (B = 2R with CFG) -> h, layer 0's norm
    xc = x.to(static.dtype)
    if cfg:
        xc = torch.cat([xc, xc])
    b, w, _ = xc.shape
    h = torch.addmm(static.reshape(b * w, -1), xc.reshape(b * w, -1), w_in_x.t()).view(b, w, -1)
    return h, _modulate(h, shift, scale)


def _dit_layer(h: torch.Tensor, n: torch.Tensor, mod: torch.Tensor, next_shift: torch.Tensor,
               next_scale: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor, wo: torch.Tensor,
               bo: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
               b2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
               heads: int, block_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    # h [B, W, D] residual stream; n [B, W, D] its modulated attention norm (this layer's);
    # mod [6, D] this layer's modulation; cos/sin [B, 1, W, hd/2]; block_frames 0: mask is
    # SDPA's additive [B, 1, W, W]; else the block kernel's frame table [B, 4]
    # -> (h, the next layer's modulated attention norm of h)
    b, w, d = h.shape
    gate, shift2, scale2, gate2 = mod[2], mod[3], mod[4], mod[5]
    qkv = F.linear(n, wqkv, bqkv)
    if block_frames:
        # (registered by dit_attention_triton, imported when the block kernel was chosen)
        att = torch.ops.omnistage.dit_block_attention(qkv, cos[:, 0], sin[:, 0], mask, heads,
                                                      block_frames)
    else:
        qkv = qkv.view(b, w, 3, heads, -1).permute(2, 0, 3, 1, 4)
        # rotary on q's and k's first head only, output in (evens, odds) order (as the module
        # does); q and k together: one op (one kernel)
        qk = torch.cat([_rope_head(qkv[:2, :, :1], cos, sin), qkv[:2, :, 1:]], dim=2)
        att = F.scaled_dot_product_attention(qk[0], qk[1], qkv[2], attn_mask=mask)
        att = att.transpose(1, 2).reshape(b, w, -1)
    h = torch.addcmul(h, gate, F.linear(att, wo, bo))
    n = _modulate(h, shift2, scale2)
    if n.is_cuda:
        # the GELU in the GEMM's epilogue (cuBLASLt's is the tanh one; the CPU version of this
        # op applies the erf GELU): no extra pass over the [B W, ff_mult D] rows
        ff = torch._addmm_activation(b1, n.reshape(b * w, d), w1.t(), use_gelu=True)
        ff = ff.view(b, w, -1)
    else:
        ff = F.gelu(F.linear(n, w1, b1), approximate="tanh")
    h = torch.addcmul(h, gate2, F.linear(ff, w2, b2))
    return h, _modulate(h, next_shift, next_scale)


def _dit_out(n: torch.Tensor, w: torch.Tensor, b: torch.Tensor, keep: torch.Tensor,
             guidance: float, cfg: bool) -> torch.Tensor:
    # n [B, W, D] the output norm; keep [R, W, 1] bool -> guided velocity [R, W, mel] float32
    v = F.linear(n, w, b).float()
    if cfg:
        v_cond, v_null = v.chunk(2)
        v = v_cond + (v_cond - v_null) * guidance
    return v.masked_fill(~keep, 0.0)


_COMPILED: tuple = ()

# the batch and window-width dims of each step function's tensors (argument index -> dims):
# marked dynamic on every call, so the first compile is already the symbolic one
_DYNAMIC_DIMS = {
    "_dit_in": {0: (0, 1), 1: (0, 1)},  # x [R, W, mel], static [B, W, D]
    # h, n [B, W, D]; cos, sin [B, 1, W, hd/2]; mask [B, 1, W, W'] (SDPA) or [B, 4] (frames)
    "_dit_layer": {0: (0, 1), 1: (0, 1), 13: (0, 2), 14: (0, 2), 15: (0, 2, 3)},
    "_dit_out": {0: (0, 1), 3: (0, 1)},  # n [B, W, D], keep [R, W, 1]
}


def _with_dynamic_dims(fn: Callable, compiled: Callable) -> Callable:
    """compiled(*args) with fn's batch and width dims marked dynamic first."""
    dims = _DYNAMIC_DIMS[fn.__name__]

    def run(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        for i, ds in dims.items():
            for d in ds:
                if d < args[i].dim():
                    torch._dynamo.maybe_mark_dynamic(args[i], d)
        return compiled(*args)

    return run


def _compiled_steps() -> tuple:
    """(_dit_in, _dit_layer, _dit_out) compiled by inductor (built once).

    NOTE (shapes): the batch and width dims are marked dynamic (_DYNAMIC_DIMS), so the first
    compile of a step function serves every (bucket, width) a warm-up graphs; only a size-1
    batch (R = 1 without CFG's doubling) specializes, as dynamo does for size-1 dims. With
    dynamo's automatic dynamic shapes alone each function compiled three times (static, then
    width-dynamic, then batch-dynamic), and static shapes compiled each of the ~45 graphed
    shapes anew."""
    global _COMPILED
    if not _COMPILED:
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, name, max(getattr(cfg, name), 64))
        _COMPILED = tuple(_with_dynamic_dims(f, torch.compile(f, fullgraph=True, dynamic=None))
                          for f in (_dit_in, _dit_layer, _dit_out))
    return _COMPILED


def _rope_head(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [..., B, 1, T, D], (even, odd) pairs rotated; cos/sin [B, 1, T, D/2] -> (evens, odds)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)
