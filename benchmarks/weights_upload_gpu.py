"""A stage's checkpoint tensors copied into GPU tensors two ways, side by side on the same
tensors: one plain `copy_` per tensor from the safetensors mmap (the reference: what
load_parameters did before) and the threads staging through pinned buffers
(omnistage/weights_upload.DeviceUploads, what it does now). Rounds alternate, the page cache
warm after the first; both sides' results are checked equal, byte for byte.

    python -m benchmarks.weights_upload_gpu --ckpt /tmp/omni7b --prefix thinker. \
        --out benchmarks/results/weights_upload_h200.json"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from benchmarks.common import write_result
from omnistage import weights_upload
from omnistage.checkpoint import iter_tensors


def plain(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(src)


def staged(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    uploads = weights_upload.DeviceUploads()
    for dst, src in pairs:
        if uploads.takes(dst, src):
            uploads.copy(dst, src)
        else:
            dst.copy_(src)
    uploads.finish()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--prefix", default="thinker.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()
    dev = torch.device("cuda")
    srcs = list(iter_tensors(Path(args.ckpt), args.prefix))
    if not srcs:
        raise SystemExit(f"--prefix: no tensor named {args.prefix!r}* in {args.ckpt}")
    gib = sum(t.numel() * t.element_size() for _, t in srcs) / 2**30
    sides = {name: [(torch.empty_like(t, device=dev), t) for _, t in srcs]
             for name in ("plain", "staged")}
    seconds: dict[str, list[float]] = {"plain": [], "staged": []}
    for _ in range(args.rounds):
        for name, fn in (("plain", plain), ("staged", staged)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(sides[name])
            torch.cuda.synchronize()
            seconds[name].append(round(time.perf_counter() - t0, 3))
    same = all(torch.equal(a, b) for (a, _), (b, _) in zip(sides["plain"], sides["staged"],
                                                          strict=True))
    best = {k: min(v) for k, v in seconds.items()}
    result = {
        "config": {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                   "ckpt": args.ckpt, "prefix": args.prefix, "tensors": len(srcs),
                   "GiB": round(gib, 2), "threads": weights_upload.THREADS,
                   "chunk_MiB": weights_upload.CHUNK_BYTES >> 20},
        "seconds": seconds,
        "GiB_per_s_best": {k: round(gib / v, 2) for k, v in best.items()},
        "speedup_best": round(best["plain"] / best["staged"], 2),
        "equal": same,
    }
    write_result(result, args.out, load_before)
    if not same:
        raise SystemExit("staged copies differ from the plain ones")


if __name__ == "__main__":
    main()
