"""private_stream(): no two live holders get the same CUDA stream from torch's round-robin pool
(a fake pool stands in for CUDA here)."""

import gc

import pytest
import torch

from omnistage.engine import streams


class FakePool:
    """torch.cuda.Stream's pool: `size` streams per priority, handed out round-robin."""

    def __init__(self, size: int) -> None:
        self.size, self.next = size, {0: 0, -1: 0}

    def stream(self, device=None, priority: int = 0):
        n = self.next[priority]
        self.next[priority] = (n + 1) % self.size
        s = type("FakeStream", (), {})()  # a fresh Python object per call, as torch's
        s.cuda_stream = (priority, n)
        return s


@pytest.fixture
def pool(monkeypatch):
    p = FakePool(4)
    monkeypatch.setattr(torch.cuda, "Stream", p.stream)
    monkeypatch.setattr(streams, "_HELD_STREAMS", {})
    return p


def test_distinct_while_held(pool):
    dev = torch.device("cuda", 0)
    held = [streams.private_stream(dev) for _ in range(3)]
    for _ in range(5):  # others take streams from the pool meanwhile (plain torch.cuda.Stream)
        torch.cuda.Stream(0)
    held.append(streams.private_stream(dev))
    assert len({s.cuda_stream for s in held}) == 4  # the whole pool, no stream twice
    high = streams.private_stream(dev, priority=-1)
    assert high.cuda_stream[0] == -1  # priorities have pools of their own
    freed = held.pop(1).cuda_stream
    gc.collect()
    again = streams.private_stream(dev)
    assert again.cuda_stream == freed  # a holder's stream is free once it is gone


def test_exhausted_pool_warns_and_shares(pool):
    dev = torch.device("cuda", 0)
    held = [streams.private_stream(dev) for _ in range(4)]
    with pytest.warns(UserWarning, match="shares a stream"):
        extra = streams.private_stream(dev)
    assert extra.cuda_stream in {s.cuda_stream for s in held}
