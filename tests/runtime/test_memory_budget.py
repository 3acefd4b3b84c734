"""gpu_memory_budget (runtime/memory.py): validation, the allocator cap and the KV sizing
arithmetic against a simulated device; the real thing on a GPU (marked)."""

import pytest
import torch

from omnistage import OmniLLM, SamplingParams
from omnistage.runtime import memory
from omnistage.runtime.memory import GIB, RESERVE_BYTES, MemoryBudget, pop_memory_budget


class FakeDevice:
    """torch.cuda's memory queries for an 80 GiB device with `used` bytes in use."""

    def __init__(self, monkeypatch, used: int, reserved: int = 0) -> None:
        self.used, self.reserved, self.total, self.fraction = used, reserved, 80 * GIB, None
        monkeypatch.setattr(torch.cuda, "mem_get_info",
                            lambda device=None: (self.total - self.used, self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device=None: type("P", (), {"total_memory": self.total}))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                            lambda f, device=None: setattr(self, "fraction", f))


def test_pop_memory_budget_bounds():
    assert pop_memory_budget({}) is None
    assert pop_memory_budget({"gpu_memory_budget": 24}) == 24.0
    for bad in (0, -1, 5000, True, "24", float("nan")):
        with pytest.raises(ValueError, match="gpu_memory_budget"):
            pop_memory_budget({"gpu_memory_budget": bad})


def test_budget_caps_the_allocator_and_sizes_kv(monkeypatch):
    dev = FakeDevice(monkeypatch, used=1 * GIB)  # the context, nothing allocated yet
    budget = MemoryBudget(24, torch.device("cuda"),
                          {"thinker": 10 * GIB, "talker": 3 * GIB, "code2wav": 1 * GIB})
    outside = 1 * GIB + memory.OUTSIDE_ALLOCATOR_MARGIN
    assert budget.allocator_cap == 24 * GIB - outside
    assert dev.fraction == pytest.approx((24 * GIB - outside) / (80 * GIB))
    cap = budget.allocator_cap
    dev.used, dev.reserved = 11 * GIB, 10 * GIB  # the thinker's weights are in
    per_block = 1 << 20
    room = cap - 10 * GIB - 4 * GIB - RESERVE_BYTES  # talker + code2wav still pending
    n = budget.kv_blocks("thinker", 0.5, per_block, want=10**9, min_blocks=8)
    assert n == int(room * 0.5) // per_block
    assert budget.kv_blocks("thinker", 0.5, per_block, want=100, min_blocks=8) == 100  # capped
    dev.reserved = 10 * GIB + n * per_block + 3 * GIB  # thinker KV + talker weights
    m = budget.kv_blocks("talker", 1.0, per_block, want=10**9, min_blocks=8)
    assert m == (cap - dev.reserved - 1 * GIB - RESERVE_BYTES) // per_block
    assert budget.pending == {"code2wav": 1 * GIB}
    with pytest.raises(ValueError, match="gpu_memory_budget.*talker needs"):
        budget.kv_blocks("talker", 1.0, per_block, want=10**9, min_blocks=m + 1)


def test_budget_too_small_for_the_weights(monkeypatch):
    FakeDevice(monkeypatch, used=1 * GIB)
    with pytest.raises(ValueError, match="gpu_memory_budget: 8 GiB cannot hold"):
        MemoryBudget(8, torch.device("cuda:0"), {"thinker": 15 * GIB})
    with pytest.raises(ValueError, match="gpu_memory_budget.*budgets a GPU"):
        MemoryBudget(8, torch.device("cpu"), {})


def test_omnillm_names_the_field(tiny_omni_dir):
    with pytest.raises(ValueError, match="gpu_memory_budget"):
        OmniLLM(str(tiny_omni_dir), device="cpu", gpu_memory_budget=24)
    with pytest.raises(ValueError, match="gpu_memory_budget"):
        OmniLLM(str(tiny_omni_dir), device="cpu", gpu_memory_budget=-3)


@pytest.mark.gpu
def test_budget_on_gpu(tiny_omni_dir):
    free, total = torch.cuda.mem_get_info()
    used = total - free
    llm = OmniLLM(str(tiny_omni_dir), device="cuda", gpu_memory_budget=used / GIB + 3,
                  quantization="fp8", max_model_len=512)
    out = llm.generate({"messages": [{"role": "user", "content": "hi"}]},
                       {"thinker": SamplingParams(temperature=0, max_tokens=6)},
                       use_tqdm=False)[0]
    assert out.error is None and out.audio is not None
    blocks = {n: e.runner.num_blocks for n, e in llm.pipeline.engines.items()}
    assert all(b >= 512 // 16 for b in blocks.values()), blocks
    free, total = torch.cuda.mem_get_info()
    assert total - free <= (used / GIB + 3) * GIB
