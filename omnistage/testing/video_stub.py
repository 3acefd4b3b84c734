"""transformers' Qwen2VLVideoProcessor stood in for where torchvision does not import (tests'
reference processors for the tiny Qwen2.5-Omni and Qwen3-Omni checkpoints).

  FrameVideoProcessor        its output, built from transformers' own parts per frame
  AcceptsVideoProcessorStub  lets a transformers processor take one of these
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
    smart_resize,
)
from transformers.utils import PushToHubMixin


class FrameVideoProcessor(PushToHubMixin):
    """Qwen2VLVideoProcessor (torchvision backend, CPU) without torchvision, from transformers'
    own parts: smart_resize with the per-frame pixel cap, the uint8 antialiased bicubic
    `interpolate` that torchvision runs on CPU, then Qwen2VLImageProcessorPil per frame (rescale,
    normalise, patchify; it repeats one frame over the temporal patch) with frame pairs joined.
    The class attributes are the video processor's settings (Qwen2-VL's defaults here; a
    family's subclass sets its own)."""

    _auto_class = None
    patch_size = 14
    merge_size = 2
    temporal_patch_size = 2
    image_mean: list[float] = list(OPENAI_CLIP_MEAN)
    image_std: list[float] = list(OPENAI_CLIP_STD)
    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
    max_video_tokens = 128000
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __call__(self, videos: Any, size: dict | None = None, **kwargs: Any) -> BatchFeature:
        # videos: one uint8 [T, H, W, 3] array or a list of them (or of frame lists)
        size = dict(size or self.size)
        frame_proc = Qwen2VLImageProcessorPil(do_resize=False, patch_size=self.patch_size,
                                              merge_size=self.merge_size,
                                              image_mean=self.image_mean,
                                              image_std=self.image_std)
        videos = [videos] if isinstance(videos, np.ndarray) else list(videos)
        tp, p, factor = self.temporal_patch_size, self.patch_size, self.patch_size * self.merge_size
        pixels, grids = [], []
        for video in videos:
            x = torch.from_numpy(np.stack(list(video))).permute(0, 3, 1, 2).contiguous()
            frames_in, _, height, width = x.shape
            budget = int(self.max_video_tokens * factor * factor * 0.9)
            max_px = max(min(size["longest_edge"], budget * tp // frames_in),
                         int(size["shortest_edge"] * 1.05))
            h, w = smart_resize(height, width, factor, size["shortest_edge"], max_px)
            x = torch.nn.functional.interpolate(x, size=(h, w), mode="bicubic", antialias=True)
            frames = [f.permute(1, 2, 0).numpy() for f in x]
            frames += frames[-1:] * (-frames_in % tp)
            # per frame [gh*gw, 3, tp, p*p] with the frame repeated over tp: keep one copy
            one = [frame_proc(images=[f], return_tensors="pt")["pixel_values"]
                   .view(-1, 3, tp, p * p)[:, :, 0] for f in frames]
            for t in range(0, len(one), tp):
                pixels.append(torch.stack(one[t:t + tp], dim=2).reshape(one[0].shape[0], -1))
            grids.append([len(one) // tp, h // p, w // p])
        return BatchFeature({"pixel_values_videos": torch.cat(pixels),
                             "video_grid_thw": torch.tensor(grids)})

    def to_dict(self) -> dict[str, Any]:
        return {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": self.patch_size,
                "merge_size": self.merge_size, "temporal_patch_size": self.temporal_patch_size,
                "size": dict(self.size)}


class AcceptsVideoProcessorStub:
    """Mixed in before a transformers processor class: its video processor may be a stand-in
    above (not a transformers class), so the type check skips that argument alone."""

    def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
        if name == "video_processor":
            return type(arg)
        return super().check_argument_for_proper_class(name, arg)
