"""Moving a stage's output between two GPUs of one host: the payloads the Qwen2.5-Omni pipeline
moves (thinker hidden rows bf16 [T, 3584], talker codes int64 [N], code2wav audio fp32), timed
three ways:
  peer:  the runtime's own path between in-process stages (runtime.stage.move_tensors: a
         device-to-device copy, cuda:0 -> cuda:1, over NVLink / PCIe peer access);
  host:  the same tensor through host memory (.cpu() then .to("cuda:1")), for comparison;
  nccl:  send/recv between two processes, one per GPU (torch.distributed, NCCL), as stages in
         processes of their own would move it (Ray is not on the GPU machines: its wheel is
         over the carry limit).
Per payload: p50 / p90 latency in microseconds (host clock around the copy and a sync of both
GPUs, --reps times after warm-up) and GB/s at p50. JSON to stdout and --out. Run:
    PYTHONPATH=$PWD python benchmarks/nccl_transfer_gpu.py --out $OUT/nccl_transfer.json
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends, set below before NCCL starts)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # omnistage and benchmarks.*
from omnistage.runtime.stage import move_tensors  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
HIDDEN = 3584  # Qwen2.5-Omni-7B thinker width


def payloads() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {f"hidden_rows_bf16_T{t}": ((t, HIDDEN), torch.bfloat16) for t in (1, 16, 128, 1024)}
    out.update({f"codes_int64_N{n}": ((n,), torch.int64) for n in (1, 24, 600)})
    out.update({f"audio_fp32_{s}s": ((24000 * s,), torch.float32) for s in (1, 10)})
    return out


def make(shape, dtype, device) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    return torch.randint(0, 8192, shape, device=device, dtype=dtype)


def summarize(times_s: list[float], nbytes: int) -> dict:
    times = sorted(times_s)
    p50 = statistics.median(times)
    return {"bytes": nbytes, "p50_us": round(1e6 * p50, 1),
            "p90_us": round(1e6 * times[int(0.9 * (len(times) - 1))], 1),
            "GB_per_s_p50": round(nbytes / p50 / 1e9, 2)}


def sync_both() -> None:
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)


def time_copy(fn, reps: int) -> list[float]:
    for _ in range(5):
        fn()
    sync_both()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync_both()
        out.append(time.perf_counter() - t)
    return out


def in_process(reps: int) -> dict:
    dst = torch.device("cuda:1")
    res = {}
    for name, (shape, dtype) in payloads().items():
        x = make(shape, dtype, "cuda:0")
        peer = time_copy(lambda x=x: move_tensors(x, dst), reps)
        host = time_copy(lambda x=x: x.cpu().to(dst), reps)
        moved = move_tensors(x, dst)
        if moved.device != dst or not torch.equal(moved.cpu(), x.cpu()):
            raise RuntimeError(f"{name}: the peer copy is wrong")
        res[name] = {"peer": summarize(peer, x.nbytes), "host": summarize(host, x.nbytes)}
    return res


def _nccl_rank(rank: int, port: int, reps: int, queue) -> None:
    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    import torch.distributed as dist
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=torch.device("cuda", rank))
    res = {}
    for name, (shape, dtype) in payloads().items():
        x = make(shape, dtype, f"cuda:{rank}")
        times = []
        for i in range(reps + 5):
            dist.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
            else:
                dist.recv(x, 0)
            torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - t)
        if rank == 1:  # the receiver's clock: from its barrier to the data on its GPU
            res[name] = summarize(times, x.nbytes)
    dist.destroy_process_group()
    if rank == 1:
        queue.put(res)


def nccl(reps: int, port: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, reps, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    res = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return res


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--port", type=int, default=29531)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.update(NO_MULTICAST)
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    res = {"device": [torch.cuda.get_device_name(i) for i in range(2)],
           "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
           "peer_access_0_to_1": torch.cuda.can_device_access_peer(0, 1),
           "reps": args.reps, "in_process": in_process(args.reps),
           "nccl_send_recv": nccl(args.reps, args.port)}
    text = json.dumps(res, indent=1)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return res


if __name__ == "__main__":
    main()
