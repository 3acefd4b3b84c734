"""Flow-matching Euler schedules, as diffusers' FlowMatchEulerDiscreteScheduler computes them
from a checkpoint's scheduler_config.json (the subset image pipelines use), in float32 numpy
like diffusers so the sigmas match to the bit."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# scheduler_config.json keys this schedule implements; others must be off (ValueError if set)
UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
               "invert_sigmas", "stochastic_sampling")


@dataclass(frozen=True)
class FlowMatchSchedule:
    """A checkpoint's scheduler config: static shift, or resolution-dependent (dynamic)
    shifting with mu = a line through (base_seq_len, base_shift), (max_seq_len, max_shift)."""

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_seq_len: int = 256
    max_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    time_shift_type: str = "exponential"
    shift_terminal: float | None = None

    @classmethod
    def from_config(cls, cfg: dict) -> FlowMatchSchedule:
        for key in UNSUPPORTED:
            if cfg.get(key):
                raise ValueError(f"scheduler_config.{key}: not supported")
        if cfg.get("time_shift_type", "exponential") not in ("exponential", "linear"):
            raise ValueError(f"scheduler_config.time_shift_type: {cfg['time_shift_type']!r}")
        return cls(num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)),
                   shift=float(cfg.get("shift", 1.0)),
                   use_dynamic_shifting=bool(cfg.get("use_dynamic_shifting", False)),
                   base_seq_len=int(cfg.get("base_image_seq_len", 256)),
                   max_seq_len=int(cfg.get("max_image_seq_len", 4096)),
                   base_shift=float(cfg.get("base_shift", 0.5)),
                   max_shift=float(cfg.get("max_shift", 1.15)),
                   time_shift_type=cfg.get("time_shift_type", "exponential"),
                   shift_terminal=cfg.get("shift_terminal") or None)

    def mu(self, image_seq_len: int) -> float:
        slope = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len)
        return image_seq_len * slope + self.base_shift - slope * self.base_seq_len

    def sigmas(self, num_steps: int, image_seq_len: int) -> tuple[list[float], list[float]]:
        """(sigmas: num_steps + 1 values ending at the terminal 0, timesteps: sigma * 1000 per
        step), from diffusers' default `linspace(1, 1/N, N)`."""
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)
        if self.use_dynamic_shifting:
            mu = self.mu(image_seq_len)
            if self.time_shift_type == "exponential":
                sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))
            else:
                sigmas = mu / (mu + (1 / sigmas - 1))
        else:
            sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
        if self.shift_terminal:
            one_minus = 1 - sigmas
            sigmas = 1 - one_minus / (one_minus[-1] / (1 - self.shift_terminal))
        sigmas = sigmas.astype(np.float32)
        timesteps = (sigmas * np.float32(self.num_train_timesteps)).astype(np.float32)
        return [*sigmas.tolist(), 0.0], timesteps.tolist()
