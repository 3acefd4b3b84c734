"""ZImageTransformer equals diffusers' ZImageTransformer2DModel (lists in, list out) on the same
random weights: padded + masked captions of different lengths, per-row timesteps, non-square
latents, image and caption lengths off and on the 32-token padding multiple."""

import pytest
import torch

from omnistage.models.z_image.transformer import ZImageTransformer
from omnistage.testing.tiny_z_image import TRANSFORMER_CONFIG, reinit_transformer_

diffusers = pytest.importorskip("diffusers")

CAP_DIM = TRANSFORMER_CONFIG["cap_feat_dim"]


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    ref = diffusers.ZImageTransformer2DModel(**TRANSFORMER_CONFIG).eval()
    reinit_transformer_(ref)
    ours = ZImageTransformer(dict(TRANSFORMER_CONFIG)).eval()
    ours.load_weights(ref.state_dict().items())
    return ref, ours


def _reference(ref, latents, timestep, captions) -> torch.Tensor:
    with torch.no_grad():
        out = ref(list(latents.unsqueeze(2).unbind(0)), timestep, captions, return_dict=False)[0]
    return torch.stack(out).squeeze(2)


def _padded(captions, filler: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    t_len = max(len(c) for c in captions)
    text = torch.full((len(captions), t_len, CAP_DIM), filler)
    mask = torch.zeros(len(captions), t_len, dtype=torch.bool)
    for i, cap in enumerate(captions):
        text[i, :len(cap)] = cap
        mask[i, :len(cap)] = True
    return text, mask


def _check_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(ref).all() and ref.std() > 0.3, "degenerate reference output"
    assert ref.flatten(1).std(dim=1).min() > 0.3
    err = (ours - ref).abs().max().item()
    assert err < 2e-5 * ref.abs().max().item(), err  # ~1e-5 of the output's scale


def test_batch_with_different_captions_timesteps_and_non_square_latents(models):
    ref, ours = models
    torch.manual_seed(1)
    latents = torch.randn(2, 16, 6, 10)  # 3 x 5 = 15 patches: padded to 32
    timestep = torch.tensor([0.25, 0.8])
    captions = [torch.randn(5, CAP_DIM), torch.randn(37, CAP_DIM)]  # padded to 32 and 64
    text, mask = _padded(captions)
    with torch.no_grad():
        out = ours(latents, timestep, text, mask)
    assert out.shape == latents.shape and out.dtype == latents.dtype
    _check_close(out, _reference(ref, latents, timestep, captions))
    for i in range(2):  # each row alone, as diffusers runs one unpadded caption
        _check_close(out[i:i + 1], _reference(ref, latents[i:i + 1], timestep[i:i + 1],
                                              captions[i:i + 1]))
    # the rows differ in caption and timestep: their outputs differ too
    assert (out[0] - out[1]).abs().mean() > 0.1


def test_empty_caption_row(models):
    # diffusers runs an empty caption as image tokens alone; ours must not turn it into NaN
    ref, ours = models
    torch.manual_seed(7)
    latents, timestep = torch.randn(2, 16, 4, 6), torch.tensor([0.3, 0.6])
    captions = [torch.randn(0, CAP_DIM), torch.randn(5, CAP_DIM)]
    with torch.no_grad():
        out = ours(latents, timestep, *_padded(captions))
    _check_close(out, _reference(ref, latents, timestep, captions))


def test_padding_slot_contents_do_not_matter(models):
    _, ours = models
    torch.manual_seed(2)
    latents = torch.randn(2, 16, 4, 4)
    timestep = torch.tensor([0.5, 0.5])
    captions = [torch.randn(3, CAP_DIM), torch.randn(40, CAP_DIM)]
    with torch.no_grad():
        clean = ours(latents, timestep, *_padded(captions, 0.0))
        junk = ours(latents, timestep, *_padded(captions, 7.0))
    assert (clean - junk).abs().max() < 1e-5


@pytest.mark.parametrize("latent_hw,cap_len", [((16, 16), 32), ((6, 4), 20), ((8, 12), 64)])
def test_no_mask(models, latent_hw, cap_len):
    # (16, 16): 64 patches and 32 tokens, no padding at all; (6, 4): both padded
    ref, ours = models
    torch.manual_seed(3)
    latents = torch.randn(2, 16, *latent_hw)
    timestep = torch.tensor([0.1, 0.9])
    captions = [torch.randn(cap_len, CAP_DIM) for _ in range(2)]
    with torch.no_grad():
        out = ours(latents, timestep, torch.stack(captions), None)
        masked = ours(latents, timestep, torch.stack(captions),
                      torch.ones(2, cap_len, dtype=torch.bool))
    _check_close(out, _reference(ref, latents, timestep, captions))
    assert (out - masked).abs().max() < 1e-5


def test_timestep_matters(models):
    _, ours = models
    torch.manual_seed(4)
    latents = torch.randn(1, 16, 4, 6).expand(2, -1, -1, -1)
    text = torch.randn(1, 9, CAP_DIM).expand(2, -1, -1)
    with torch.no_grad():
        out = ours(latents, torch.tensor([0.0, 1.0]), text, None)
    assert (out[0] - out[1]).abs().mean() > 0.1


def test_bf16_equals_diffusers_bf16(models):
    # bf16 rounds the same places as diffusers (fp32 norms, rope and timestep sinusoids)
    ref, _ = models
    ref16 = diffusers.ZImageTransformer2DModel(**TRANSFORMER_CONFIG).eval()
    ref16.load_state_dict(ref.state_dict())
    ref16.to(torch.bfloat16)
    ours = ZImageTransformer(dict(TRANSFORMER_CONFIG)).eval()
    ours.load_weights(ref.state_dict().items())
    ours.to(torch.bfloat16)
    torch.manual_seed(5)
    latents = torch.randn(2, 16, 4, 6)
    timestep = torch.tensor([0.3, 0.6])
    captions = [torch.randn(7, CAP_DIM), torch.randn(12, CAP_DIM)]
    with torch.no_grad():
        half = ours(latents, timestep, *_padded(captions))
    assert half.dtype == torch.float32  # returned in the latents' dtype
    expected = _reference(ref16, latents.bfloat16(), timestep,
                          [c.bfloat16() for c in captions]).float()
    exact = _reference(ref, latents, timestep, captions)
    assert (half - expected).norm() / expected.norm() < 1e-2
    assert (half - exact).norm() / exact.norm() < 0.1  # bf16 itself: ~5% here


def test_load_weights_rejects_bad_checkpoints(models):
    ref, _ = models
    state = dict(ref.state_dict())
    ours = ZImageTransformer(dict(TRANSFORMER_CONFIG))
    missing = {k: v for k, v in state.items() if k != "cap_pad_token"}
    with pytest.raises(ValueError, match="missing"):
        ours.load_weights(missing.items())
    with pytest.raises(ValueError, match="no matching parameter"):
        ours.load_weights([*state.items(), ("layers.9.attention.to_q.weight", torch.zeros(64, 64))])
    bad = dict(state, **{"layers.0.attention.to_q.weight": torch.zeros(64, 32)})
    with pytest.raises(ValueError, match="shape"):
        ours.load_weights(bad.items())


def test_rejects_bad_config_and_inputs(models):
    _, ours = models
    with pytest.raises(ValueError, match="siglip_feat_dim"):
        ZImageTransformer({**TRANSFORMER_CONFIG, "siglip_feat_dim": 8})
    with pytest.raises(ValueError, match="axes_dims"):
        ZImageTransformer({**TRANSFORMER_CONFIG, "axes_dims": [4, 6, 8]})
    latents, t = torch.randn(1, 16, 4, 4), torch.tensor([0.5])
    with pytest.raises(ValueError, match="latents"):
        ours(torch.randn(1, 16, 5, 4), t, torch.randn(1, 3, CAP_DIM), None)
    with pytest.raises(ValueError, match="text_mask"):
        ours(latents, t, torch.randn(1, 3, CAP_DIM), torch.ones(1, 3))
    with pytest.raises(ValueError, match="timestep"):
        ours(latents, torch.tensor([0.5, 0.5]), torch.randn(1, 3, CAP_DIM), None)


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager(models):
    """Fixed shapes capture (no host syncs), and a replay with new inputs equals eager."""
    ref, _ = models
    ours = ZImageTransformer(dict(TRANSFORMER_CONFIG)).eval()
    ours.load_weights(ref.state_dict().items())
    ours.to("cuda", torch.bfloat16)
    torch.manual_seed(6)
    args = [torch.randn(2, 16, 8, 6, device="cuda"), torch.rand(2, device="cuda"),
            torch.randn(2, 40, CAP_DIM, device="cuda"),
            torch.arange(40, device="cuda")[None] < torch.tensor([[9], [40]], device="cuda")]
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ours(*args)  # warm-up: fills the rope caches
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ours(*args)
        new = [torch.randn_like(args[0]), torch.rand_like(args[1]), torch.randn_like(args[2]),
               torch.arange(40, device="cuda")[None] < torch.tensor([[33], [2]], device="cuda")]
        for buf, value in zip(args, new):
            buf.copy_(value)
        graph.replay()
        eager = ours(*new)
    torch.testing.assert_close(out, eager)
