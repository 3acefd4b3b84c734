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
        # torch reads a seed modulo 2^64 but raises outside [-2^63, 2^64): wrap, same noise
        gen = torch.Generator().manual_seed(int(seed) % (1 << 64))
        return torch.randn(1, max_frames, mel_dim, generator=gen)[0, :num_frames].clone()

    def check_voice(self, cond: torch.Tensor, ref_mel: torch.Tensor, cond_name: str = "cond",
                    ref_name: str = "ref_mel") -> tuple[torch.Tensor, torch.Tensor]:
        """Check one voice; returns (cond [1, E], ref_mel [1, L, M]). Errors name the fields."""
        spec = self.spec
        min_ref = self.code2wav_dit_model.input_embed.spk_encoder.min_frames
        for name, t in ((cond_name, cond), (ref_name, ref_mel)):
            if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
                raise ValueError(f"{name}: expected a floating-point torch.Tensor")
        if cond.numel() != spec.enc_emb_dim or cond.dim() > 2:
            raise ValueError(f"{cond_name}: expected shape [{spec.enc_emb_dim}] or "
                             f"[1, {spec.enc_emb_dim}], got {list(cond.shape)}")
        r = ref_mel.unsqueeze(0) if ref_mel.dim() == 2 else ref_mel
        if r.dim() != 3 or r.shape[0] != 1 or r.shape[2] != spec.mel_dim:
            raise ValueError(f"{ref_name}: expected shape [L, {spec.mel_dim}] or "
                             f"[1, L, {spec.mel_dim}], got {list(ref_mel.shape)}")
        if r.shape[1] < min_ref:
            raise ValueError(f"{ref_name}: needs at least {min_ref} frames")
        for name, t in ((cond_name, cond), (ref_name, r)):
            if not torch.isfinite(t).all():
                raise ValueError(f"{name}: contains NaN or inf")
        return cond.reshape(1, -1), r

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
            s, r = self.check_voice(s, r, f"conds[{i}]", f"ref_mels[{i}]")
            if z.dim() == 3 and z.shape[0] == 1:
                z = z[0]
            if tuple(z.shape) != (frames, spec.mel_dim):
                raise ValueError(f"noises[{i}]: expected shape [{frames}, {spec.mel_dim}] "
                                 f"(codes x {spec.repeats}), got {list(z.shape)}")
            if not torch.isfinite(z).all():
                raise ValueError(f"noises[{i}]: contains NaN or inf")
            out.append((c.long(), s, r, z.unsqueeze(0)))
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
        mels = self.sample_mels([(c, s, r, z[0], 0) for c, s, r, z in reqs], int(num_steps),
                                float(guidance_scale), sway_coefficient)
        mels = [m.transpose(0, 1) for m in mels]
        return [m.float() for m in mels], self.vocode(mels)

    def sample_mels(self, rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                           int]], num_steps: int = 10,
                    guidance_scale: float = 0.5, sway_coefficient: float | None = -1.0
                    ) -> list[torch.Tensor]:
        """Run the ODE for R frame windows in one padded DiT batch (inputs already checked).

        rows[i] = (codes [1, N_i], cond [1, E], ref_mel [1, L_i, M], noise [N_i * repeats, M],
        start_i): the window's frames sit at absolute positions start_i + [0, N_i * repeats),
        which set the rotary angles and the attention blocks.
        Returns mels[i] [N_i * repeats, M] in the model's dtype, on its device.
        """
        p = next(self.parameters())
        dev, dt = p.device, p.dtype
        dit, use_cfg = self.code2wav_dit_model, guidance_scale >= 1e-5
        frames = [z.shape[0] for _, _, _, z, _ in rows]
        t_max, r = max(frames), len(rows)

        noise = torch.zeros(r, t_max, self.spec.mel_dim, device=dev, dtype=dt)
        static_rows = []
        for i, (c, s, ref, z, _) in enumerate(rows):
            noise[i, :frames[i]] = z.to(dev, dt)
            # speaker encoder and code embedding are fixed over the ODE: computed once per row
            st = dit.static_condition(c.to(dev), s.to(dev, dt), ref.to(dev, dt), use_cfg)
            static_rows.append(nn.functional.pad(st, (0, 0, 0, t_max - frames[i])))
        # batch layout: [cond rows of all requests; uncond rows of all requests]
        static = torch.cat([st[k:k + 1] for k in range(2 if use_cfg else 1) for st in static_rows])
        starts = torch.tensor([row[4] for row in rows], device=dev)
        positions = starts[:, None] + torch.arange(t_max, device=dev)
        valid = torch.arange(t_max, device=dev) < torch.tensor(frames, device=dev)[:, None]
        mel = dit.sample(noise, static, positions, valid, num_steps, guidance_scale,
                         sway_coefficient)
        return [mel[i, :f] for i, f in enumerate(frames)]

    def vocode(self, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """BigVGAN on mels[i] [M, F_i] -> waveforms[i] [F_i * hop] float32 on the model's device.

        NOTE: its convs pad at the sequence ends, so only mels of equal length share a batch.
        """
        by_len: dict[int, list[int]] = defaultdict(list)
        for i, m in enumerate(mels):
            by_len[m.shape[1]].append(i)
        wavs: list[torch.Tensor] = [torch.empty(0)] * len(mels)
        for idx in by_len.values():
            out = self.code2wav_bigvgan_model(torch.stack([mels[i] for i in idx]))
            for j, i in enumerate(idx):
                wavs[i] = out[j].float()
        return wavs
