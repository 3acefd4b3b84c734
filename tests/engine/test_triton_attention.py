"""Triton paged attention vs a pure-torch reference (CPU via TRITON_INTERPRET=1; GPU marked)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: kernels then run in triton's numpy interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from omnistage.engine.ar import triton_attention  # noqa: E402
from omnistage.engine.ar.triton_attention import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=[16, 64], ids=["tile16", "tile64"])
def key_tile(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Key-tile size; 16 makes the short test sequences cross unmasked and masked tiles."""
    monkeypatch.setattr(triton_attention, "_DECODE_BLOCK_N", request.param)
    monkeypatch.setattr(triton_attention, "_PREFILL_BLOCK_N", request.param)
    return request.param


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Gathers each sequence's blocks, causal softmax in fp32 (queries = last q_len tokens)."""
    # q: [T, H, D] -> [T, H, D] fp32
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(seq_lens.shape[0]):
        n = int(seq_lens[b])
        q0, q1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        blocks = block_tables[b, : (n + page - 1) // page].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        qb = q[q0:q1].float()  # [L, H, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = torch.arange(n - (q1 - q0), n, device=q.device)
        causal = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def make_cache(seq_lens: list[int], page: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, seed: int = 0):
    """Random paged K/V with shuffled blocks. Every slot a sequence does not own is NaN and
    padding block-table entries point at NaN blocks: a read past a length poisons the output."""
    gen = torch.Generator().manual_seed(seed)
    need = [(n + page - 1) // page for n in seq_lens]
    max_blocks = max(need) + 2
    num_blocks = sum(need) + 3
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    # Block 0 stays NaN too: masked block-table loads fall back to it.
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    spare = torch.cat([torch.zeros(1, dtype=torch.long), perm[sum(need):]])  # NaN-only blocks
    block_tables = spare[torch.randint(len(spare), (len(seq_lens), max_blocks), generator=gen)]
    used = 0
    for b, n in enumerate(seq_lens):
        own = perm[used: used + need[b]]
        used += need[b]
        block_tables[b, : need[b]] = own
        for i in range(n):
            blk, off = own[i // page], i % page
            k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    return (k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(torch.int32).to(DEVICE))


def check_close(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float = 0.0) -> float:
    assert torch.isfinite(out).all(), "kernel output has NaN/inf (read past a sequence?)"
    assert ref.abs().mean() > 0.05, "reference output is trivially small"
    err = (out.float() - ref).abs()
    diff = err.max().item()
    print(f"max abs diff {diff:.2e} (ref mean |x| {ref.abs().mean().item():.3f})")
    worst = (err - rtol * ref.abs()).max().item()
    assert worst < atol, f"max abs diff {diff:.3e}: exceeds {atol} + {rtol} * |ref|"
    return diff


@pytest.mark.parametrize("group,num_splits", [(2, 1), (2, 3), (4, 1), (4, 3)])
def test_decode_fp32(group: int, num_splits: int, key_tile: int) -> None:
    lens, page, kv_heads, head_dim = [1, 17, 70], 16, 2, 16
    k_cache, v_cache, bt = make_cache(lens, page, kv_heads, head_dim, torch.float32, seed=group)
    q = torch.randn(len(lens), kv_heads * group, head_dim, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, head_dim**-0.5, num_splits)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    ref = reference_attention(q, k_cache, v_cache, bt, qsl, seq_lens, head_dim**-0.5)
    assert out.dtype == q.dtype and out.shape == q.shape
    check_close(out, ref, 1e-4)


def test_decode_head_dim_8_auto_splits_and_empty_row(key_tile: int) -> None:
    # head_dim 8 is padded to 16 inside the kernel; seq_len 0 rows (batch padding) give zeros.
    lens, page, kv_heads, head_dim = [70, 63], 16, 1, 8
    k_cache, v_cache, bt = make_cache(lens, page, kv_heads, head_dim, torch.float32, seed=5)
    q = torch.randn(3, 2, head_dim, device=DEVICE)
    bt = torch.cat([bt, bt[:1]])
    seq_lens = torch.tensor(lens + [0], dtype=torch.int32, device=DEVICE)
    for splits in (None, 2):
        out = paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, 0.3, splits)
        ref = reference_attention(q[:2], k_cache, v_cache, bt, torch.arange(3), seq_lens[:2], 0.3)
        check_close(out[:2], ref, 1e-4)
        assert torch.equal(out[2], torch.zeros_like(out[2]))


def _prefill_case(dtype: torch.dtype, group: int, prefix: tuple[int, ...] = (0, 16, 5),
                  q_lens: tuple[int, ...] = (7, 20, 1)):
    page, kv_heads, head_dim = 16, 2, 16
    lens = [p + n for p, n in zip(prefix, q_lens, strict=True)]
    k_cache, v_cache, bt = make_cache(lens, page, kv_heads, head_dim, dtype, seed=7)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim).to(dtype).to(DEVICE)
    qsl = torch.tensor([0, *q_lens], dtype=torch.int32, device=DEVICE).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(q, k_cache, v_cache, bt, qsl, seq_lens, max(q_lens), 0.25)
    ref = reference_attention(q, k_cache, v_cache, bt, qsl, seq_lens, 0.25)
    assert out.dtype == dtype and out.shape == q.shape
    return out, ref


@pytest.mark.parametrize("group", [2, 3, 4])
def test_prefill_fp32(group: int, key_tile: int) -> None:
    out, ref = _prefill_case(torch.float32, group)
    check_close(out, ref, 1e-4)


def test_prefill_tile_boundaries(key_tile: int) -> None:
    # First query one or two short of a tile edge: the unmasked-tile bound must stop there.
    out, ref = _prefill_case(torch.float32, 2, prefix=(14, 62, 15, 0), q_lens=(3, 2, 18, 63))
    check_close(out, ref, 1e-4)


def test_prefill_bf16(key_tile: int) -> None:
    out, ref = _prefill_case(torch.bfloat16, 4)
    check_close(out, ref, 2e-2)


def test_decode_bf16(key_tile: int) -> None:
    lens, page, kv_heads, group, head_dim = [1, 17, 70], 16, 2, 4, 16
    k_cache, v_cache, bt = make_cache(lens, page, kv_heads, head_dim, torch.bfloat16, seed=3)
    q = torch.randn(3, kv_heads * group, head_dim).to(torch.bfloat16).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, 0.25, 3)
    ref = reference_attention(q, k_cache, v_cache, bt, torch.arange(4), seq_lens, 0.25)
    assert out.dtype == torch.bfloat16
    check_close(out, ref, 2e-2)


def test_bad_inputs_raise() -> None:
    k_cache, v_cache, bt = make_cache([5], 16, 2, 16, torch.float32)
    seq_lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_decode_attention(torch.randn(1, 3, 16, device=DEVICE), k_cache, v_cache, bt,
                               seq_lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(torch.randn(1, 4, 16, device=DEVICE).half(), k_cache, v_cache,
                               bt, seq_lens, 1.0)


def _random_gpu_batch(lens: torch.Tensor, page: int, kv_heads: int, head_dim: int):
    """Dense-ish random cache with shuffled blocks for large GPU shapes (no NaN fill)."""
    need = (lens + page - 1) // page
    max_blocks = int(need.max())
    num_blocks = int(need.sum())
    k_cache = torch.randn(num_blocks, page, kv_heads, head_dim, device="cuda",
                          dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    bt = torch.zeros(len(lens), max_blocks, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(need.tolist()):
        bt[b, :n] = perm[start: start + n]
        start += n
    return k_cache, v_cache, bt


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_large_shapes() -> None:
    torch.manual_seed(0)
    batch, heads, kv_heads, head_dim, page = 64, 28, 4, 128, 16
    lens = torch.randint(1, 4097, (batch,))
    lens[0], lens[1] = 4096, 1
    k_cache, v_cache, bt = _random_gpu_batch(lens, page, kv_heads, head_dim)
    seq_lens = lens.to(torch.int32).cuda()
    scale = head_dim**-0.5
    # Scaled-up q: a peaked softmax keeps outputs O(1) over 4096 random keys.
    q = 4 * torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    ref = reference_attention(q, k_cache, v_cache, bt, torch.arange(batch + 1), seq_lens, scale)
    for splits in (None, 1, 8):
        out = paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, scale, splits)
        check_close(out, ref, 2e-2, 1e-2)

    # CUDA graph capture of decode: replay after changing seq_lens in place.
    static_out = paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, scale)
    seq_lens.copy_((lens // 2 + 1).to(torch.int32))
    graph.replay()
    ref2 = reference_attention(q, k_cache, v_cache, bt, torch.arange(batch + 1), seq_lens, scale)
    check_close(static_out, ref2, 2e-2, 1e-2)

    # Prefill: 8 sequences with cached prefixes and chunks up to 1024 tokens.
    q_lens = torch.tensor([1024, 1, 300, 17, 512, 1, 64, 999])
    prefix = torch.tensor([0, 4000, 128, 5, 1000, 0, 3000, 77])
    lens = prefix + q_lens
    k_cache, v_cache, bt = _random_gpu_batch(lens, page, kv_heads, head_dim)
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).cuda()
    seq_lens = lens.to(torch.int32).cuda()
    q = 4 * torch.randn(int(q_lens.sum()), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = paged_prefill_attention(q, k_cache, v_cache, bt, qsl, seq_lens, int(q_lens.max()),
                                  scale)
    check_close(out, reference_attention(q, k_cache, v_cache, bt, qsl, seq_lens, scale), 2e-2, 1e-2)
