"""Voices of a Qwen2.5-Omni checkpoint (spk_dict.pt): per name, the thinker token used as the
talker's bos row, code2wav's 192-d (tiny: smaller) speaker cond, and its reference mel."""

from __future__ import annotations

from pathlib import Path

import torch

MAX_VOICES = 64


def load_voices(path: Path) -> dict[str, dict]:
    f = Path(path) / "spk_dict.pt"
    if not f.is_file():
        raise ValueError(f"model: {path} has a talker but no spk_dict.pt (the voices)")
    table = torch.load(f, map_location="cpu", weights_only=True)
    if not isinstance(table, dict) or not table or len(table) > MAX_VOICES:
        raise ValueError(f"model: {f} is not a table of voices")
    voices = {}
    for name, v in table.items():
        if not isinstance(v, dict) or not {"bos_token", "cond", "ref_mel"} <= set(v):
            raise ValueError(f"model: {f}: voice {name!r} needs bos_token, cond and ref_mel")
        ref = v["ref_mel"]
        voices[str(name)] = {"bos_token": int(v["bos_token"]),
                             "cond": v["cond"].reshape(-1).float(),
                             "ref_mel": ref.reshape(-1, ref.shape[-1]).float()}
    return voices
