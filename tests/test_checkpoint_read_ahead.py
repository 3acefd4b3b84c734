"""Checkpoint tensors read ahead on a thread (checkpoint.read_ahead / iter_tensors): the same
tensors in the same order, the reader's errors raised to the consumer, and a consumer that
stops early stops the reader."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import save_file

from omnistage.checkpoint import iter_tensors, read_ahead


def test_iter_tensors_reads_every_tensor_in_order(tmp_path) -> None:
    tensors = {f"model.layers.{i}.w": torch.full((3, i + 1), float(i)) for i in range(7)}
    tensors["other.bias"] = torch.arange(4.0)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    got = list(iter_tensors(tmp_path, "model."))
    # safetensors lists names sorted; the prefix is stripped, the rest is skipped
    assert [n for n, _ in got] == sorted(n.removeprefix("model.") for n in tensors
                                         if n.startswith("model."))
    for name, t in got:
        assert torch.equal(t, tensors["model." + name])


def test_read_ahead_keeps_order_and_bounds_the_lead() -> None:
    produced: list[int] = []

    def items():
        for i in range(50):
            produced.append(i)
            yield i

    seen = []
    for i in read_ahead(items(), 2):
        seen.append(i)
        # the reader is at most depth items ahead (+1 in its hand, waiting for room)
        assert len(produced) <= len(seen) + 3
    assert seen == list(range(50))


def test_a_reader_error_reaches_the_consumer_after_the_items_before_it() -> None:
    def items():
        yield 1
        yield 2
        raise OSError("disk gone")

    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for i in read_ahead(items(), 4):
            seen.append(i)
    assert seen == [1, 2]


def test_stopping_early_stops_the_reader_and_closes_its_source() -> None:
    closed = threading.Event()

    def items():
        try:
            yield from range(1000)
        finally:
            closed.set()

    it = read_ahead(items(), 2)
    assert next(it) == 0
    it.close()  # (a load that failed on a tensor)
    assert closed.is_set()
    assert not any(t.name == "omnistage-read-ahead" for t in threading.enumerate())
