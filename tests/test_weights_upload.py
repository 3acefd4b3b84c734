"""checkpoint.load_parameters' staged GPU copies (weights_upload.DeviceUploads): every
parameter equals its checkpoint tensor, byte for byte, whether it went through the pinned
buffers (several chunks, both buffers of a thread reused; a copy to another floating dtype
converted on the GPU, narrowing or widening) or a plain copy (small)."""

import pytest
import torch
from safetensors.torch import save_file

from omnistage import weights_upload
from omnistage.checkpoint import iter_tensors, load_parameters


class _Weights(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.empty(300, 1000, dtype=torch.bfloat16))
        self.odd = torch.nn.Parameter(torch.empty(7, 3001, dtype=torch.bfloat16))  # odd bytes
        self.small = torch.nn.Parameter(torch.empty(16, dtype=torch.bfloat16))
        self.converted = torch.nn.Parameter(torch.empty(64, 1000, dtype=torch.float16))
        self.widened = torch.nn.Parameter(torch.empty(7, 3001, dtype=torch.float32))


def test_takes_only_large_gpu_copies() -> None:
    up = weights_upload.DeviceUploads()
    src = torch.zeros(1 << 20, dtype=torch.uint8)
    assert not up.takes(torch.zeros(1 << 20, dtype=torch.uint8), src)  # a CPU parameter
    up.finish()  # nothing started: nothing to wait for


@pytest.mark.gpu
def test_staged_copies_equal_the_checkpoint(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(weights_upload, "CHUNK_BYTES", 64 << 10)  # many chunks per tensor
    monkeypatch.setattr(weights_upload, "MIN_BYTES", 1 << 10)
    g = torch.Generator().manual_seed(0)
    ckpt = {"big": torch.randn(300, 1000, generator=g).bfloat16(),
            "odd": torch.randn(7, 3001, generator=g).bfloat16(),
            "small": torch.randn(16, generator=g).bfloat16(),
            "converted": torch.randn(64, 1000, generator=g),  # float32 on disk
            "widened": torch.randn(7, 3001, generator=g).bfloat16()}  # (a bf16 vocoder's)
    save_file(ckpt, str(tmp_path / "model.safetensors"))
    with torch.device("cuda"):
        module = _Weights()
    staged = []
    takes = weights_upload.DeviceUploads.takes

    def spy(self, dst, src):
        staged.append(takes(self, dst, src))
        return staged[-1]

    monkeypatch.setattr(weights_upload.DeviceUploads, "takes", spy)
    load_parameters(module, iter_tensors(tmp_path))
    assert sorted(staged) == [False, True, True, True, True]  # all but small staged
    for name, want in ckpt.items():
        got = getattr(module, name).detach().cpu()
        assert torch.equal(got, want.to(got.dtype)), name
        assert got.abs().max() > 0.5
