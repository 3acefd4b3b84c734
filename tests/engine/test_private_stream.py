"""private_stream(): no two live holders get the same CUDA stream from torch's round-robin pool
(a fake pool stands in for CUDA here)."""

import gc
import weakref

import pytest
import torch

from omnistage.engine import streams


class FakePool:
    """torch.cuda.Stream's pool: `size` streams per priority, handed out round-robin."""

    def __init__(self, size: int) -> None:
        self.size, self.next = size, {0: 0, -1: 0}
        pool = self

        class FakeStream:
            """A fresh Python object per call, as torch's. No __weakref__ slot: a weakref to a
            real CUDA stream dangles once it is freed (streams.py's NOTE), so private_stream
            must take none; here taking one raises TypeError."""

            __slots__ = ("cuda_stream", "device")

            def __init__(self, device=None, priority: int = 0) -> None:
                n = pool.next[priority]
                pool.next[priority] = (n + 1) % pool.size
                self.cuda_stream, self.device = (priority, n), torch.device("cuda", 0)
        self.stream = FakeStream


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
    with pytest.raises(TypeError):  # (see FakeStream)
        weakref.ref(held[0])
    freed = held.pop(1).cuda_stream
    assert freed not in streams._HELD_STREAMS[0]  # given back when freed, no collection needed
    again = streams.private_stream(dev)
    assert again.cuda_stream == freed  # a holder's stream is free once it is gone


def test_exhausted_pool_warns_and_shares(pool):
    dev = torch.device("cuda", 0)
    held = [streams.private_stream(dev) for _ in range(4)]
    with pytest.warns(UserWarning, match="shares a stream"):
        extra = streams.private_stream(dev)
    assert extra.cuda_stream in {s.cuda_stream for s in held}
    shared = extra.cuda_stream
    del extra  # a stream that shares a holder's raw stream does not give it back
    gc.collect()
    assert shared in streams._HELD_STREAMS[0]
    held.clear()
    assert not streams._HELD_STREAMS[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stream_given_back_when_freed():
    # a real CUDA stream: given back by its __del__ (a weakref to it would dangle instead)
    stream = streams.private_stream(torch.device("cuda", 0))
    raw = stream.cuda_stream
    assert isinstance(stream, torch.cuda.Stream) and raw in streams._HELD_STREAMS[0]
    with torch.cuda.stream(stream):
        x = torch.ones(4, device="cuda") * 2
    stream.synchronize()
    assert x.sum().item() == 8
    del stream
    assert raw not in streams._HELD_STREAMS[0]
