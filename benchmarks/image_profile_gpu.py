"""Where an image pipeline's time goes, ours beside diffusers: one DiT forward (1 and 2 rows),
eager and with torch.compile'd blocks, one VAE decode and one prompt encode, at real widths
(the DiT at `--layers` layers, so both fit on one GPU; per-layer time scales linearly).

    python -m benchmarks.image_profile_gpu --family qwen_image --layers 20 --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from benchmarks.common import timed, write_result
from benchmarks.image_gpu import diffusers_pipeline, real_shape_folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=["qwen_image", "z_image"], default="qwen_image")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--text-len", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also time compiled blocks")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load = os.getloadavg()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    root = Path(tempfile.mkdtemp(prefix="image_profile_"))
    from omnistage.checkpoint import dummy_tensors, load_parameters, read_json
    from omnistage.runtime.build import build_model
    try:
        path = real_shape_folder(args.family, root, tiny=args.tiny)
        cfg_path = path / "transformer" / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["num_layers" if args.family == "qwen_image" else "n_layers"] = args.layers
        cfg_path.write_text(json.dumps(cfg))
        pipe = diffusers_pipeline(args.family, path, device, dtype)
        pipe.vae.disable_slicing()
        result: dict = {"config": {**vars(args), "device": torch.cuda.get_device_name()
                                   if cuda else "cpu"}}
        h = w = args.size // 16
        g = torch.Generator(device).manual_seed(0)  # (h, w: the VAE's latent grid / 2)
        if args.family == "qwen_image":
            from omnistage.models.qwen_image.transformer import QwenImageTransformer as Ours
            from omnistage.models.qwen_image.vae import QwenImageVAEDecoder as OursVAE
            d_text = cfg["joint_attention_dim"]
        else:
            from omnistage.models.autoencoder_kl import AutoencoderKLDecoder as OursVAE
            from omnistage.models.z_image.transformer import ZImageTransformer as Ours
            d_text = cfg["cap_feat_dim"]
        ours = build_model(lambda c: _Shell(Ours(c)), cfg, [], device, dtype).module
        load_parameters(ours, dummy_tensors(ours))
        for rows in (1, 2):
            result.update(dit_times(args, ours, pipe, rows, d_text, g, device, dtype))
        if args.compile:
            blocks = (ours.transformer_blocks if args.family == "qwen_image" else ours.layers)
            for block in blocks:
                block.forward = torch.compile(block.forward)
            result.update(dit_times(args, ours, None, 1, d_text, g, device, dtype, "_compiled"))
        ours.to("meta")  # (frees its memory for the VAE's)
        vae_cfg = read_json(path / "vae" / "config.json")
        vae = build_model(lambda c: _Shell(OursVAE(c)), vae_cfg, [], device, dtype).module
        load_parameters(vae, dummy_tensors(vae))
        z = torch.randn(1, 16, 2 * h, 2 * w, device=device, dtype=dtype, generator=g)
        with torch.inference_mode():
            result["ours_vae_ms"] = timed(lambda: vae.decode(z), args.reps)
            z5 = z[:, :, None] if args.family == "qwen_image" else z
            result["diffusers_vae_ms"] = timed(lambda: pipe.vae.decode(z5), args.reps)
        write_result(result, args.out, load)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def dit_times(args, ours, pipe, rows: int, d_text: int, g, device: str, dtype: torch.dtype,
              tag: str = "") -> dict:
    """ms of one DiT forward of `rows` rows: ours, and diffusers' (pipe not None)."""
    h = w = args.size // 16
    text = torch.randn(rows, args.text_len, d_text, device=device, dtype=dtype, generator=g)
    t = torch.full((rows,), 0.5, device=device)
    out = {}
    with torch.inference_mode():
        if args.family == "qwen_image":
            lat = torch.randn(rows, h * w, 64, device=device, dtype=dtype, generator=g)
            out[f"ours_dit_rows{rows}{tag}_ms"] = timed(
                lambda: ours(lat, t, text, None, (h, w)), args.reps)
            if pipe is not None:
                out[f"diffusers_dit_rows{rows}_ms"] = timed(lambda: pipe.transformer(
                    hidden_states=lat, timestep=t, encoder_hidden_states=text,
                    encoder_hidden_states_mask=None, img_shapes=[[(1, h, w)]] * rows,
                    return_dict=False), args.reps)
        else:
            lat = torch.randn(rows, 16, 2 * h, 2 * w, device=device, dtype=dtype, generator=g)
            out[f"ours_dit_rows{rows}{tag}_ms"] = timed(lambda: ours(lat, t, text, None),
                                                        args.reps)
            if pipe is not None:
                out[f"diffusers_dit_rows{rows}_ms"] = timed(lambda: pipe.transformer(
                    list(lat.unsqueeze(2).unbind(0)), t, list(text.unbind(0)),
                    return_dict=False), args.reps)
    return out


class _Shell(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def load_weights(self, tensors) -> None:
        pass


if __name__ == "__main__":
    main()
