"""Qwen2.5-Omni code2wav stage model: codec ids -> mel (DiT flow matching) -> 24 kHz waveform.

`Qwen2_5OmniToken2Wav.generate` runs several requests of different lengths in one padded DiT
batch per ODE evaluation; each request's result equals running it alone.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from .token2wav_bigvgan import Qwen2_5OmniToken2WavBigVGAN
from .token2wav_dit import Qwen2_5OmniDiTSpec, Qwen2_5OmniToken2WavDiT

# transformers' DiT rejects longer mels (dit_config.max_position_embeddings on the real model)
NOISE_MAX_FRAMES = 32768


class Qwen2_5OmniToken2Wav(nn.Module):
    """The checkpoint's `token2wav.*` module (prefix stripped): DiT + BigVGAN, fp32 by design."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        if not isinstance(config, dict):
            raise ValueError("token2wav_config: expected a dict with dit_config and bigvgan_config")
        self.spec = Qwen2_5OmniDiTSpec.from_dict(config.get("dit_config") or {})
        bigvgan_cfg = config.get("bigvgan_config") or {}
        if bigvgan_cfg.get("mel_dim", 80) != self.spec.mel_dim:
            raise ValueError("token2wav_config.bigvgan_config.mel_dim: must equal "
                             "dit_config.mel_dim")
        self.code2wav_dit_model = Qwen2_5OmniToken2WavDiT(self.spec)
        self.code2wav_bigvgan_model = Qwen2_5OmniToken2WavBigVGAN(bigvgan_cfg)

    @staticmethod
    def initial_noise(seed: int, num_frames: int, mel_dim: int = 80,
                      max_frames: int = NOISE_MAX_FRAMES) -> torch.Tensor:
        """The ODE's starting noise for `num_frames` frames: [num_frames, mel_dim] fp32 on CPU.

        NOTE: torch's CPU normal sampler fills in groups of 16 values, so as long as the count is
        a multiple of 16 (mel_dim = 80 is), a prefix of a long draw equals a short draw. Drawing
        [1, max_frames, mel_dim] and slicing therefore equals transformers'
        `torch.manual_seed(seed); torch.randn(1, num_frames, mel_dim)`, and a frame's noise does
        not depend on the utterance length (what streaming needs).
        """
        if not 0 < num_frames <= max_frames:
            raise ValueError(f"num_frames: must be in [1, {max_frames}], got {num_frames}")
        if (max_frames * mel_dim) % 16 or (num_frames * mel_dim) % 16:
            raise ValueError("mel_dim: frames * mel_dim must be a multiple of 16 for prefix-stable "
                             "noise")
        gen = torch.Generator().manual_seed(int(seed))
        return torch.randn(1, max_frames, mel_dim, generator=gen)[0, :num_frames].clone()

    def _validate(self, codes: list[torch.Tensor], conds: list[torch.Tensor],
                  ref_mels: list[torch.Tensor], noises: list[torch.Tensor], num_steps: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Check and normalise shapes: per request (codes [1, N], cond [1, E], ref [1, L, M],
        noise [1, N * repeats, M])."""
        spec, n = self.spec, len(codes)
        for name, seq in (("codes", codes), ("conds", conds), ("ref_mels", ref_mels),
                          ("noises", noises)):
            if not isinstance(seq, (list, tuple)):
                raise ValueError(f"{name}: expected a list of tensors")
            if len(seq) != n:
                raise ValueError(f"{name}: {len(seq)} entries for {n} requests")
        if n == 0:
            raise ValueError("codes: no requests")
        if int(num_steps) < 2:
            raise ValueError(f"num_steps: must be >= 2, got {num_steps}")
        min_ref = self.code2wav_dit_model.input_embed.spk_encoder.min_frames
        out = []
        for i, (c, s, r, z) in enumerate(zip(codes, conds, ref_mels, noises, strict=True)):
            for name, t in (("codes", c), ("conds", s), ("ref_mels", r), ("noises", z)):
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"{name}[{i}]: expected a torch.Tensor")
            if c.dtype.is_floating_point or c.dtype.is_complex or c.dtype == torch.bool:
                raise ValueError(f"codes[{i}]: expected integer ids, got {c.dtype}")
            c = c.reshape(1, -1) if c.dim() == 1 or (c.dim() == 2 and c.shape[0] == 1) else None
            if c is None:
                raise ValueError(f"codes[{i}]: expected shape [N] or [1, N]")
            if c.shape[1] == 0:
                raise ValueError(f"codes[{i}]: empty")
            if int(c.min()) < 0 or int(c.max()) > spec.num_embeds:
                raise ValueError(f"codes[{i}]: ids must be in [0, {spec.num_embeds}], got "
                                 f"[{int(c.min())}, {int(c.max())}]")
            frames = c.shape[1] * spec.repeats
            if frames > spec.max_position_embeddings:
                raise ValueError(f"codes[{i}]: {frames} mel frames exceed "
                                 f"max_position_embeddings {spec.max_position_embeddings}")
            if s.numel() != spec.enc_emb_dim or s.dim() > 2:
                raise ValueError(f"conds[{i}]: expected shape [{spec.enc_emb_dim}] or "
                                 f"[1, {spec.enc_emb_dim}], got {list(s.shape)}")
            if r.dim() == 2:
                r = r.unsqueeze(0)
            if r.dim() != 3 or r.shape[0] != 1 or r.shape[2] != spec.mel_dim:
                raise ValueError(f"ref_mels[{i}]: expected shape [L, {spec.mel_dim}] or "
                                 f"[1, L, {spec.mel_dim}], got {list(r.shape)}")
            if r.shape[1] < min_ref:
                raise ValueError(f"ref_mels[{i}]: needs at least {min_ref} frames")
            if z.dim() == 3 and z.shape[0] == 1:
                z = z[0]
            if tuple(z.shape) != (frames, spec.mel_dim):
                raise ValueError(f"noises[{i}]: expected shape [{frames}, {spec.mel_dim}] "
                                 f"(codes x {spec.repeats}), got {list(z.shape)}")
            for name, t in (("conds", s), ("ref_mels", r), ("noises", z)):
                if not torch.isfinite(t).all():
                    raise ValueError(f"{name}[{i}]: contains NaN or inf")
            out.append((c.long(), s.reshape(1, -1), r, z.unsqueeze(0)))
        return out

    @torch.inference_mode()
    def generate(self, codes: list[torch.LongTensor], conds: list[torch.Tensor],
                 ref_mels: list[torch.Tensor], noises: list[torch.Tensor], num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Decode R requests in one padded batch.

        codes[i] [N_i] codec ids; conds[i] [E] or [1, E] speaker vector (spk_dict "cond");
        ref_mels[i] [L_i, 80] or [1, L_i, 80]; noises[i] [N_i * repeats, 80] (see initial_noise).
        Returns (mels, waveforms): mels[i] [80, F_i] (transformers' orientation) and
        waveforms[i] [F_i * 240] float32, both on the model's device. Mutates nothing.
        """
        reqs = self._validate(codes, conds, ref_mels, noises, num_steps)
        p = next(self.parameters())
        dev, dt = p.device, p.dtype
        dit, use_cfg = self.code2wav_dit_model, guidance_scale >= 1e-5
        frames = [z.shape[1] for _, _, _, z in reqs]
        t_max, r = max(frames), len(reqs)

        noise = torch.zeros(r, t_max, self.spec.mel_dim, device=dev, dtype=dt)
        static_rows = []
        for i, (c, s, ref, z) in enumerate(reqs):
            noise[i, :frames[i]] = z[0].to(dev, dt)
            # speaker encoder and code embedding are fixed over the ODE: computed once per request
            st = dit.static_condition(c.to(dev), s.to(dev, dt), ref.to(dev, dt), use_cfg)
            static_rows.append(nn.functional.pad(st, (0, 0, 0, t_max - frames[i])))
        # batch layout: [cond rows of all requests; uncond rows of all requests]
        static = torch.cat([st[k:k + 1] for k in range(2 if use_cfg else 1) for st in static_rows])
        positions = torch.arange(t_max, device=dev).expand(r, t_max)
        valid = positions < torch.tensor(frames, device=dev)[:, None]
        mel = dit.sample(noise, static, positions, valid, int(num_steps), float(guidance_scale),
                         sway_coefficient)
        mels = [mel[i, :f].transpose(0, 1) for i, f in enumerate(frames)]

        # BigVGAN pads at the sequence ends: batch only mels of equal length
        by_len: dict[int, list[int]] = defaultdict(list)
        for i, f in enumerate(frames):
            by_len[f].append(i)
        wavs: list[torch.Tensor] = [torch.empty(0)] * r
        for idx in by_len.values():
            out = self.code2wav_bigvgan_model(torch.stack([mels[i] for i in idx]))
            for j, i in enumerate(idx):
                wavs[i] = out[j].float()
        return [m.float() for m in mels], wavs
