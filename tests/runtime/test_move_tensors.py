"""move_tensors (link messages between stages on different devices): tensors move next to the
receiving stage, except a field marked HOST_DATA, which the next stage reads on the CPU
(Qwen3-Omni's talker -> code2wav codes). The "meta" device stands in for a GPU here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.models.qwen3_omni.talker import TalkerFrames
from omnistage.runtime.stage import move_tensors

META = torch.device("meta")


@dataclass
class _Rows:
    rows: torch.Tensor
    extra: tuple[int, torch.Tensor]
    finished: bool


def test_tensors_move_to_the_receiving_device() -> None:
    msg = _Rows(torch.ones(2, 3), (4, torch.zeros(1)), False)
    moved = move_tensors(msg, META)
    assert moved is not msg and msg.rows.device.type == "cpu"  # the sender's copy is untouched
    assert moved.rows.device == META and moved.extra[1].device == META
    assert moved.extra[0] == 4 and moved.finished is False
    assert move_tensors(moved, META) is moved  # nothing left to move: the same object


def test_host_data_stays_on_the_host() -> None:
    codes = torch.arange(32).view(2, 16)
    msg = TalkerFrames(codes, finished=True)
    moved = move_tensors(msg, META)
    assert moved is msg and moved.codes is codes and moved.codes.device.type == "cpu"
