"""Parity of CausalTextEncoder with transformers (fp32, CPU, tiny random configs): Qwen-Image's
Qwen2.5-VL `hidden_states[-1]` and Z-Image's Qwen3 `hidden_states[-2]`, loaded from
save_pretrained safetensors by name (the real loading path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
)

from omnistage.checkpoint import iter_tensors, load_config
from omnistage.models.layers import DecoderConfig, RotaryEmbedding
from omnistage.models.text_encoder import CausalTextEncoder, text_decoder_config

ATOL = 1e-4
LENGTHS = (9, 5)  # a right-padded batch of two prompts
VOCAB = 128


def _sharpen(model: torch.nn.Module) -> None:
    """transformers' init (std 0.02, unit norms, zero biases) makes every layer a near-identity
    perturbation; widen the weights so attention, norms and biases all matter."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    T = max(LENGTHS)
    ids = torch.randint(0, 100, (len(LENGTHS), T), generator=gen)  # specials live at 120+
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def _saved(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def _ours(path: Path, output_layer: int) -> CausalTextEncoder:
    enc = CausalTextEncoder(load_config(path), output_layer).eval()
    enc.load_weights(iter_tensors(path))
    return enc


def _assert_lively(h: torch.Tensor) -> None:
    assert torch.isfinite(h).all()
    assert h.abs().mean() > 0.05, "degenerate output: near zero"
    assert h.std(dim=0).mean() > 0.05, "degenerate output: the same for every position"
    assert 0.05 < h.std() < 100


def _assert_real_rows_close(ours: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> None:
    real = mask.bool()
    _assert_lively(ref[real])
    torch.testing.assert_close(ours[real], ref[real], atol=ATOL, rtol=1e-4)


# ---------------------------------------------------------------------------- Qwen2.5-VL


@pytest.fixture(scope="module")
def qwen2_5_vl_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=64, fullatt_block_indexes=[0]),
        image_token_id=120, video_token_id=121, vision_start_token_id=122,
        vision_end_token_id=123)
    config.text_config.bos_token_id = config.text_config.eos_token_id = 124
    model = Qwen2_5_VLForConditionalGeneration(config)
    _sharpen(model)
    return _saved(model, tmp_path_factory.mktemp("qwen2_5_vl"))


def test_qwen2_5_vl_last_hidden_matches_transformers(qwen2_5_vl_dir: Path) -> None:
    ref_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        qwen2_5_vl_dir, attn_implementation="eager").eval()
    ids, mask = _batch()
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask,
                        output_hidden_states=True).hidden_states[-1]
        enc = _ours(qwen2_5_vl_dir, -1)
        ours = enc(ids, mask)
    assert enc.norm is not None and len(enc.layers) == 3
    assert ours.shape == ref.shape
    _assert_real_rows_close(ours, ref, mask)


def test_qwen2_5_vl_names_on_disk_and_in_memory_both_load(qwen2_5_vl_dir: Path) -> None:
    """transformers 5.24 saves Qwen2.5-VL under its pre-v5 names (`model.layers.N`, `visual.*`)
    while its module tree says `model.language_model.layers.N`, `model.visual.*`: both load,
    the vision tower and lm_head are skipped."""
    names = [n for n, _ in iter_tensors(qwen2_5_vl_dir)]
    assert any(n.startswith("visual.") for n in names)
    assert "model.layers.0.self_attn.q_proj.bias" in names  # Qwen2 qkv bias
    assert "lm_head.weight" in names
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl_dir)
    state = model.state_dict()
    assert "model.language_model.layers.0.self_attn.q_proj.bias" in state
    assert any(n.startswith("model.visual.") for n in state)
    from_memory = CausalTextEncoder(load_config(qwen2_5_vl_dir), -1).eval()
    from_memory.load_weights(state.items())
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(from_memory(ids, mask), _ours(qwen2_5_vl_dir, -1)(ids, mask),
                                   atol=0, rtol=0)


def test_qwen2_5_vl_legacy_flat_config_reads_the_same(qwen2_5_vl_dir: Path) -> None:
    """Older saves (the released Qwen-Image folder) keep the text keys at the top level with
    rope_scaling {"type": "mrope"}; both layouts give one DecoderConfig."""
    nested = load_config(qwen2_5_vl_dir)
    text = dict(nested["text_config"])
    rope = dict(text.pop("rope_parameters"))
    flat = {**text, "model_type": "qwen2_5_vl", "rope_theta": rope.pop("rope_theta"),
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
            "vision_config": nested["vision_config"]}
    new, family = text_decoder_config(nested)
    assert family == "qwen2"
    assert text_decoder_config(flat)[0] == new
    assert new.attention_bias and new.head_dim == 16 and new.mrope_section == (2, 3, 3)


def test_text_only_mrope_equals_plain_rope() -> None:
    """Equal t/h/w positions: each frequency rotates with the same position, so mrope = 1-D
    rope; unequal ones (an image grid) differ, so the check can fail."""
    base = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=4, rope_theta=10000.0)
    mrope = RotaryEmbedding(DecoderConfig.from_hf(
        {**base, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}}))
    plain = RotaryEmbedding(DecoderConfig.from_hf(base))
    pos = torch.arange(11)
    cos3, sin3 = mrope(pos.expand(3, -1))
    cos1, sin1 = plain(pos)
    torch.testing.assert_close(cos3, cos1, atol=0, rtol=0)
    torch.testing.assert_close(sin3, sin1, atol=0, rtol=0)
    cos_grid, _ = mrope(torch.stack([pos, pos // 2, pos % 3]))
    assert not torch.allclose(cos_grid, cos1)


# ---------------------------------------------------------------------------- Qwen3


def _qwen3_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=124, eos_token_id=124)


@pytest.fixture(scope="module", params=[Qwen3Model, Qwen3ForCausalLM],
                ids=["Qwen3Model", "Qwen3ForCausalLM"])
def qwen3(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """Diffusers' Z-Image tests use Qwen3Model (names `layers.N...`); a Qwen3ForCausalLM save
    (`model.layers.N...`) must load too."""
    torch.manual_seed(0)
    model = request.param(_qwen3_config())
    _sharpen(model)
    path = _saved(model, tmp_path_factory.mktemp(request.param.__name__))
    return request.param.from_pretrained(path, attn_implementation="eager").eval(), path


def test_qwen3_second_to_last_hidden_matches_transformers(qwen3) -> None:
    ref_model, path = qwen3
    ids, mask = _batch()
    with torch.no_grad():
        # as pipeline_z_image.py calls it (bool mask)
        ref = ref_model(input_ids=ids, attention_mask=mask.bool(),
                        output_hidden_states=True).hidden_states[-2]
        enc = _ours(path, -2)
        ours = enc(ids, mask)
    assert enc.norm is None and len(enc.layers) == 3  # layer 4 and the final norm not built
    _assert_real_rows_close(ours, ref, mask)


def test_qwen3_every_output_layer_matches_transformers(qwen3) -> None:
    ref_model, path = qwen3
    ids, mask = _batch()
    with torch.no_grad():
        refs = ref_model(input_ids=ids, attention_mask=mask, output_hidden_states=True
                         ).hidden_states
        assert len(refs) == 5
        for index in (-5, -4, -3, -1, 0, 2, 4):
            _assert_real_rows_close(_ours(path, index)(ids, mask), refs[index], mask)


def test_qwen3_has_qk_norm_and_no_bias(qwen3) -> None:
    _, path = qwen3
    enc = CausalTextEncoder(load_config(path), -1)
    attn = enc.layers[0].self_attn
    assert attn.q_norm is not None and attn.k_norm is not None
    assert attn.q_proj.bias is None and attn.o_proj.bias is None
    assert attn.head_dim == 24  # config head_dim, not hidden_size / heads


def test_no_mask_equals_masked_on_real_rows_and_padding_stays_finite(qwen3) -> None:
    """Right padding: pad keys only follow real ones, so plain causal attention gives the same
    real rows; an all-padding row is still finite."""
    _, path = qwen3
    enc = _ours(path, -2)
    ids, mask = _batch()
    mask = torch.cat([mask, torch.zeros_like(mask[:1])])
    ids = torch.cat([ids, torch.zeros_like(ids[:1])])
    with torch.no_grad():
        masked, plain = enc(ids, mask), enc(ids, None)
    assert torch.isfinite(masked).all()
    real = mask.bool()
    torch.testing.assert_close(masked[real], plain[real], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(masked[0, LENGTHS[0] - 1], masked[1, LENGTHS[0] - 1])


# ---------------------------------------------------------------------------- errors


def test_loading_rejects_missing_and_misshaped_tensors(qwen3) -> None:
    _, path = qwen3
    config = load_config(path)
    tensors = dict(iter_tensors(path))
    prefix = "model." if "model.norm.weight" in tensors else ""
    missing = {k: v for k, v in tensors.items() if k != f"{prefix}layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="missing tensors.*layers.1.mlp.up_proj.weight"):
        CausalTextEncoder(config, -2).load_weights(missing.items())
    bad = dict(tensors)
    bad[f"{prefix}layers.0.self_attn.k_norm.weight"] = torch.ones(7)
    with pytest.raises(ValueError, match="k_norm.weight.*shape"):
        CausalTextEncoder(config, -2).load_weights(bad.items())
    stray = {**tensors, f"{prefix}layers.0.self_attn.rogue.weight": torch.ones(2)}
    with pytest.raises(ValueError, match="rogue"):
        CausalTextEncoder(config, -2).load_weights(stray.items())


def test_config_and_input_validation(qwen3) -> None:
    _, path = qwen3
    config = load_config(path)
    for bad in (5, -6, 1.0, True):
        with pytest.raises(ValueError, match="output_layer"):
            CausalTextEncoder(config, bad)
    with pytest.raises(ValueError, match="model_type"):
        CausalTextEncoder({**config, "model_type": "llama"}, -1)
    with pytest.raises(ValueError, match="use_sliding_window"):
        CausalTextEncoder({**config, "use_sliding_window": True}, -1)
    enc = CausalTextEncoder(config, -1)
    ids, mask = _batch()
    with pytest.raises(ValueError, match="input_ids"):
        enc(ids[0], None)
    with pytest.raises(ValueError, match="attention_mask"):
        enc(ids, mask[:, :-1])


def test_config_json_round_trip_is_plain_json(qwen2_5_vl_dir: Path) -> None:
    """The constructor takes the folder's config.json as read from disk."""
    with open(qwen2_5_vl_dir / "config.json") as f:
        config = json.load(f)
    assert CausalTextEncoder(config, -1).config.num_hidden_layers == 3


# ---------------------------------------------------------------------------- bf16 / GPU


def _assert_bf16_close(bf16: torch.Tensor, fp32: torch.Tensor) -> None:
    """bf16 through 3 sharpened layers: max error about 8% of the output's std (measured)."""
    assert bf16.dtype == torch.bfloat16
    err = (bf16.float() - fp32).abs()
    assert err.max() < 0.15 * fp32.std() and err.mean() < 0.02 * fp32.std()


def test_bf16_close_to_fp32(qwen3) -> None:
    _, path = qwen3
    ids, mask = _batch()
    real = mask.bool()
    with torch.no_grad():
        fp32 = _ours(path, -2)(ids, mask)
        bf16 = _ours(path, -2).to(torch.bfloat16)(ids, mask)
    _assert_bf16_close(bf16[real], fp32[real])


@pytest.mark.gpu
def test_bf16_cuda_graph_matches_eager(qwen3) -> None:
    """Fixed [B, T]: one warm-up call fills the shape cache, then the forward captures (no host
    syncs) and replays to the eager result."""
    _, path = qwen3
    enc = _ours(path, -2).cuda().to(torch.bfloat16)
    ids, mask = (t.cuda() for t in _batch())
    with torch.no_grad():
        eager = enc(ids, mask)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            enc(ids, mask)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = enc(ids, mask)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        fp32 = _ours(path, -2).cuda()(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(out[real], eager[real])
    _assert_bf16_close(out[real], fp32[real])
