"""The Qwen3-Omni thinker on the AR engine, and the MoE decoder alone, against transformers'
modules on the same tiny random weights (fp32, CPU): greedy tokens and logits for text prompts
(prefix cache, chunked prefill) and for a prompt with an audio and an image (deepstack, 3-axis
interleaved mrope), the exported intermediate layer, the talker LM (shared expert) and the code
predictor (dense, 1-D rope; also through the layer pieces without a paged cache)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorConfig,
    Qwen3OmniMoeTalkerTextConfig,
    Qwen3OmniMoeThinkerConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorModel,
    Qwen3OmniMoeTalkerModel,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    _get_feat_extract_output_lengths,
)

from omnistage.engine.ar.attention import AttentionMetadata
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.interface import ForwardBatch
from omnistage.engine.ar.kernels import KernelOptions, configure_kernels
from omnistage.engine.ar.scheduler import EngineConfig
from omnistage.engine.ar.sequence import Sequence
from omnistage.layers.moe_decoder import MoEDecoderConfig, MoEDecoderModel, load_named_tensors
from omnistage.models.qwen2_5_omni.processor import MediaItem, ProcessedPrompt
from omnistage.models.qwen3_omni.thinker import Qwen3OmniThinkerForCausalLM, thinker_sequence
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_lm import scale_weights_
from tests.engine.hf_reference import assert_greedy_match

MAX_NEW = 10
LOGIT_ATOL = 1e-4
HIDDEN_ATOL = 1e-5
AUDIO_ID, IMAGE_ID, VIDEO_ID = 100, 101, 102
AUDIO_START, AUDIO_END, VISION_START, VISION_END, USER = 103, 104, 105, 106, 107
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
         "interleaved": True, "mrope_interleaved": True}
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=16,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
            rope_parameters=MROPE)
AUDIO = dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
             d_model=16, output_dim=32, n_window=50, n_window_infer=200, conv_chunksize=3,
             downsample_hidden_size=8, max_source_positions=1500)
VISION = dict(depth=3, hidden_size=16, num_heads=2, intermediate_size=32, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32,
              num_position_embeddings=64, deepstack_visual_indexes=[0, 2])
AUDIO_FRAMES, IMAGE_GRID = 130, (1, 4, 8)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


# ------------------------------------------------------------------------- helpers
def per_expert_names(state: dict[str, torch.Tensor], rename=lambda n: n):
    """transformers' fused expert tensors -> the released checkpoint's per-expert names."""
    for name, t in state.items():
        name = rename(name)
        if name.endswith("experts.gate_up_proj"):
            base, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}{e}.gate_proj.weight", t[e, :inter]
                yield f"{base}{e}.up_proj.weight", t[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                yield f"{name.removesuffix('down_proj')}{e}.down_proj.weight", t[e]
        else:
            yield name, t


def release_name(name: str) -> str:
    """transformers 5's thinker module names -> the checkpoint's (after `thinker.`)."""
    for ours, theirs in (("model.", "model.language_model."), ("audio_tower.",
                                                              "model.audio_tower."),
                         ("visual.", "model.visual.")):
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return name


def widen_(model: torch.nn.Module, seed: int = 0) -> None:
    """LM std 0.1 (stable greedy argmax); norm weights 1 + noise so they matter."""
    torch.manual_seed(seed)
    scale_weights_(model, 0.1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))


def dense_batch(model: MoEDecoderModel, positions: torch.Tensor, block_size: int = 8
                ) -> ForwardBatch:
    """One sequence prefilled whole, KV in fresh paged caches bound to the layers."""
    T, dev = positions.shape[-1], positions.device
    blocks = -(-T // block_size)
    for layer in model.layers:
        a = layer.self_attn
        a.k_cache = torch.zeros(blocks, block_size, a.num_kv_heads, a.head_dim, device=dev,
                                dtype=a.q_proj.weight.dtype)
        a.v_cache = torch.zeros_like(a.k_cache)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T, device=dev),
        query_start_loc=torch.tensor([0, T], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([T], dtype=torch.int32, device=dev),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None],
        query_lens_cpu=[T], seq_lens_cpu=[T], max_query_len=T, decode_only=T == 1)
    return ForwardBatch(input_ids=torch.zeros(T, dtype=torch.long, device=dev),
                        positions=positions, attn=meta)


def check_close(ours: torch.Tensor, ref: torch.Tensor, atol: float, label: str) -> None:
    assert ours.shape == ref.shape, (label, ours.shape, ref.shape)
    assert ref.abs().mean() > 0.05 and ref.std(0).mean() > 0.05, f"{label}: degenerate reference"
    diff = (ours - ref).abs().max().item()
    assert diff <= atol, f"{label}: max abs diff {diff:.3g} > {atol}"


# ------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hf():
    cfg = Qwen3OmniMoeThinkerConfig(
        text_config=TEXT, audio_config=AUDIO, vision_config=VISION, audio_token_id=AUDIO_ID,
        image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, audio_start_token_id=AUDIO_START,
        vision_start_token_id=VISION_START, user_token_id=USER)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(cfg).eval()
    widen_(model)
    return model


@pytest.fixture(scope="module")
def ours(hf):
    model = Qwen3OmniThinkerForCausalLM(hf.config.to_dict()).eval()
    model.load_weights(per_expert_names(hf.state_dict(), release_name))
    return model


@pytest.fixture(scope="module")
def media():
    """A prompt with an audio and an image: (hf kwargs, ProcessedPrompt)."""
    gen = torch.Generator().manual_seed(1)
    n_audio = int(_get_feat_extract_output_lengths(torch.tensor(AUDIO_FRAMES), 50))
    t, h, w = IMAGE_GRID
    n_image = t * h * w // 4
    ids = [USER, 5, 6, AUDIO_START] + [AUDIO_ID] * n_audio + [AUDIO_END, 7, VISION_START]
    ids += [IMAGE_ID] * n_image + [VISION_END, 8, 9, 10]
    feats = torch.randn(128, AUDIO_FRAMES, generator=gen)
    pixels = torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=gen)
    grid = torch.tensor([IMAGE_GRID])
    input_ids = torch.tensor([ids])
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  input_features=feats[None],
                  feature_attention_mask=torch.ones(1, AUDIO_FRAMES, dtype=torch.long),
                  pixel_values=pixels, image_grid_thw=grid)
    a0, i0 = ids.index(AUDIO_ID), ids.index(IMAGE_ID)
    items = [MediaItem("audio", 0, a0, n_audio, b"audio"), MediaItem("image", 0, i0, n_image,
                                                                     b"image")]
    prompt = ProcessedPrompt(ids, [feats], pixels, grid, items, None, 0, "",
                             placeholder_ids={"audio": AUDIO_ID, "image": IMAGE_ID,
                                              "video": VIDEO_ID})
    return kwargs, prompt


def with_positions(hf, kwargs: dict, prompt: ProcessedPrompt) -> ProcessedPrompt:
    pos, delta = hf.get_rope_index(
        kwargs["input_ids"], kwargs["image_grid_thw"], None, kwargs["attention_mask"],
        audio_seqlens=kwargs["feature_attention_mask"].sum(-1))
    prompt.mrope_positions, prompt.rope_delta = pos[:, 0].long(), int(delta[0, 0])
    return prompt


@torch.no_grad()
def hf_reference(hf, kwargs: dict, max_new: int = MAX_NEW):
    """(greedy ids, per-step logits, full-sequence logits [P + n - 1, V], hidden_states)."""
    out = hf.generate(**kwargs, do_sample=False, max_new_tokens=max_new, output_logits=True,
                      return_dict_in_generate=True)
    ids = out.sequences[0, kwargs["input_ids"].shape[1]:].tolist()
    full = torch.cat([kwargs["input_ids"], torch.tensor([ids[:-1]])], dim=1)
    fwd = hf(**dict(kwargs, input_ids=full, attention_mask=torch.ones_like(full)),
             output_hidden_states=True)
    return ids, [s[0] for s in out.logits], fwd.logits[0], [h[0] for h in fwd.hidden_states]


def run_engine(model, seqs: list[Sequence], one_by_one: bool = False, **engine_kw):
    """Our engine over seqs: ({id: tokens}, {id: {position: final hidden row}} of the
    export_hidden seqs, {id: {position: exported row}} (single-sequence steps), {id: [logits
    [1, V] of each sampling step]} (one_by_one runs), the engine)."""
    cfg = dict(max_model_len=256, max_num_seqs=4, block_size=8, cuda_graphs="off")
    eng = AREngine(model, EngineConfig(**(cfg | engine_kw)), torch.device("cpu"), torch.float32,
                   eos_token_ids=set())
    tokens: dict[str, list[int]] = {}
    hidden: dict[str, dict[int, torch.Tensor]] = {}
    exported: dict[str, dict[int, torch.Tensor]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    compute_logits = model.compute_logits
    for group in ([[s] for s in seqs] if one_by_one else [seqs]):
        calls: list[torch.Tensor] = []
        model.compute_logits = _recording(compute_logits, calls)
        try:
            for s in group:
                eng.add_request(s)
            while eng.has_unfinished():
                _collect(model, eng.step(), tokens, hidden, exported)
        finally:
            del model.compute_logits  # the instance attribute: back to the method
        if len(group) == 1:
            logits[group[0].request_id] = calls
    return tokens, hidden, exported, logits, eng


def _recording(fn, calls: list):
    def record(hidden: torch.Tensor) -> torch.Tensor:
        calls.append(fn(hidden))
        return calls[-1]
    return record


def _collect(model, updates, tokens: dict, hidden: dict, exported: dict) -> None:
    for u in updates:
        tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
        if u.hidden is None:
            continue
        first, rows = u.hidden
        if model.export_layer is not None:  # [n, 2D]: final rows, then the exported layer's
            for i, row in enumerate(model.exported_rows(rows)):
                exported.setdefault(u.request_id, {})[first + i] = row.clone()
            rows = rows[:, :model.config.hidden_size]
        for i, row in enumerate(rows):
            hidden.setdefault(u.request_id, {})[first + i] = row.clone()


def check_against_reference(model, label: str, ours_ids: list[int], ref,
                            hidden: dict | None = None, step_logits: list | None = None) -> None:
    """Tokens equal (near-tie rule); logits at every position (hidden) or at each sampling
    step (step_logits) within LOGIT_ATOL, as far as both runs had the same inputs."""
    ref_ids, ref_step_logits, ref_logits, _ = ref
    assert len(set(ref_ids)) > 1, f"{label}: degenerate reference tokens {ref_ids}"
    assert_greedy_match(ours_ids, ref_ids, ref_step_logits, label)
    same = next((i for i, (a, b) in enumerate(zip(ours_ids, ref_ids)) if a != b), len(ref_ids))
    if hidden is not None:  # rows up to the input of the first differing token's successor
        n = ref_logits.shape[0] - (len(ref_ids) - 1) + same
        rows = torch.stack([hidden[p] for p in range(min(n, ref_logits.shape[0]))])
        check_close(model.compute_logits(rows), ref_logits[:rows.shape[0]], LOGIT_ATOL,
                    f"{label} logits")
    if step_logits is not None:
        assert len(step_logits) == len(ours_ids)
        n = min(same + 1, len(ref_ids))
        check_close(torch.cat(step_logits[:n]), torch.stack(ref_step_logits[:n]), LOGIT_ATOL,
                    f"{label} step logits")


# ------------------------------------------------------------------------- thinker
def _text_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(1, 99, (21,), generator=gen).tolist()
    return [shared + [11, 12, 13], shared + [14], torch.randint(1, 99, (9,),
                                                                generator=gen).tolist()]


@pytest.mark.parametrize("regime", ["prefix_cache", "chunks_of_8"])
def test_text_prompts_equal_transformers(hf, ours, regime):
    prompts = _text_prompts()
    if regime == "prefix_cache":
        # one after the other: the second hits the first's blocks (export_hidden sequences
        # bypass the prefix cache, so the logits are the sampling steps')
        seqs = [Sequence(f"r{i}", p, GREEDY, seed=i) for i, p in enumerate(prompts)]
        tokens, hidden, _, logits, eng = run_engine(ours, seqs, one_by_one=True)
        assert eng.stats["prefix_cache_hit_tokens"] >= 16
    else:
        seqs = [Sequence(f"r{i}", p, GREEDY, seed=i, export_hidden=True)
                for i, p in enumerate(prompts)]
        tokens, hidden, _, logits, eng = run_engine(ours, seqs, max_num_batched_tokens=8)
        assert eng.stats["num_steps"] > MAX_NEW + 4  # prompts split over several steps
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        ref = hf_reference(hf, dict(input_ids=ids, attention_mask=torch.ones_like(ids)))
        check_against_reference(ours, f"{regime}/prompt {i}", tokens[f"r{i}"], ref,
                                hidden.get(f"r{i}"), logits.get(f"r{i}"))


def test_audio_image_prompt_equals_transformers(hf, ours, media):
    kwargs, prompt = media
    prompt = with_positions(hf, kwargs, prompt)
    assert len(set(prompt.mrope_positions[1].tolist())) < prompt.mrope_positions.shape[1]
    text = _text_prompts()[2]
    seqs = [thinker_sequence("mm", prompt, GREEDY, seed=0, export_hidden=True),
            Sequence("txt", text, GREEDY, seed=1, export_hidden=True)]
    tokens, hidden, _, _, _ = run_engine(ours, seqs, max_num_batched_tokens=8)
    check_against_reference(ours, "audio+image", tokens["mm"], hf_reference(hf, kwargs),
                            hidden["mm"])
    ids = torch.tensor([text])
    ref = hf_reference(hf, dict(input_ids=ids, attention_mask=torch.ones_like(ids)))
    check_against_reference(ours, "text beside media", tokens["txt"], ref, hidden["txt"])


@torch.no_grad()
def test_deepstack_matters(ours, media):
    """The deepstack columns change the output (so the parity above covers them)."""
    _, prompt = media
    seq = thinker_sequence("a", prompt, GREEDY, seed=0)
    ours.encode_media([seq])
    width = ours.config.hidden_size
    embeds = seq.prompt_embeds
    assert embeds.shape == (len(prompt.input_ids), width * 3)
    image = torch.tensor(prompt.input_ids) == IMAGE_ID
    assert embeds[image, width:].abs().min(dim=-1).values.gt(0).any()
    assert embeds[~image, width:].abs().max() == 0  # audio and text rows: no deepstack
    P = len(prompt.input_ids)
    pos = torch.arange(P).expand(3, -1)
    batch = dense_batch(ours.model, pos)
    batch.inputs_embeds, batch.embeds_mask = embeds, seq.prompt_embeds_mask
    batch.input_ids = torch.tensor(prompt.input_ids)
    with_ds = ours(batch)
    batch = dense_batch(ours.model, pos)
    batch.inputs_embeds, batch.embeds_mask = embeds[:, :width], seq.prompt_embeds_mask
    batch.input_ids = torch.tensor(prompt.input_ids)
    assert (ours(batch) - with_ds).abs().max() > 1e-2


@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_exported_layer_equals_hidden_states(hf, ours, media, layer):
    kwargs, prompt = media
    prompt = with_positions(hf, kwargs, prompt)
    ref = hf_reference(hf, kwargs, max_new=4)
    ours.export_layer = layer
    try:
        seq = thinker_sequence("mm", prompt, SamplingParams(temperature=0, max_tokens=4), seed=0,
                               export_hidden=True)
        _, _, exported, _, _ = run_engine(ours, [seq], max_num_batched_tokens=8)
    finally:
        ours.export_layer = None
    expect = ref[3][layer]
    rows = torch.stack([exported["mm"][p] for p in range(expect.shape[0])])
    check_close(rows, expect, HIDDEN_ATOL, f"hidden_states[{layer}]")


def test_export_layer_out_of_range(ours):
    ours.export_layer = 4
    try:
        with pytest.raises(ValueError, match="export_layer"):
            ours(dense_batch(ours.model, torch.arange(3)))
    finally:
        ours.export_layer = None


# ------------------------------------------------------------------------- decoder alone
def _positions_3d(T: int) -> torch.Tensor:
    t = torch.arange(T)
    return torch.stack([t, t // 2 + 3, t % 5 + 1])  # distinct axes: the interleaving matters


@torch.no_grad()
def test_decoder_equals_talker_model():
    cfg = Qwen3OmniMoeTalkerTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        shared_expert_intermediate_size=24, rope_parameters=MROPE)
    hf_model = Qwen3OmniMoeTalkerModel(cfg).eval()
    widen_(hf_model, seed=3)
    ours_cfg = MoEDecoderConfig.from_hf(cfg.to_dict(), mrope_interleaved=True)
    assert ours_cfg.shared_expert_intermediate_size == 24 and all(ours_cfg.sparse_layers)
    model = MoEDecoderModel(ours_cfg, embed_tokens=False).eval()
    load_named_tensors(model, per_expert_names(hf_model.state_dict()),
                       skip=lambda n: n.startswith("codec_embedding."))
    T = 21
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(4))
    pos = _positions_3d(T)
    ref = hf_model(inputs_embeds=x[None], position_ids=pos[:, None]).last_hidden_state[0]
    got, exported = model(x, dense_batch(model, pos))
    assert exported is None
    check_close(got, ref, HIDDEN_ATOL, "talker")


@torch.no_grad()
def test_decoder_equals_code_predictor_model():
    cfg = Qwen3OmniMoeTalkerCodePredictorConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_code_groups=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf_model = Qwen3OmniMoeTalkerCodePredictorModel(cfg).eval()
    widen_(hf_model, seed=5)
    ours_cfg = MoEDecoderConfig.from_hf(cfg.to_dict())
    assert ours_cfg.num_experts == 0 and ours_cfg.mrope_section is None
    model = MoEDecoderModel(ours_cfg, embed_tokens=False).eval()
    load_named_tensors(model, hf_model.state_dict().items(),
                       skip=lambda n: n.startswith("codec_embedding."))
    T = 17
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(6))
    ref = hf_model(inputs_embeds=x[None]).last_hidden_state[0]
    got, _ = model(x, dense_batch(model, torch.arange(T)))
    check_close(got, ref, HIDDEN_ATOL, "code predictor (paged)")
    # the pieces alone, around plain causal attention (the code predictor's own small cache)
    cos, sin = model.rotary_emb(torch.arange(T))
    h = x
    for layer in model.layers:
        q, k, v = layer.qkv(h, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), is_causal=True, enable_gqa=True)
        h = layer.attn_out_mlp(h, o.transpose(0, 1))
    check_close(model.norm(h), ref, HIDDEN_ATOL, "code predictor (pieces)")


@pytest.mark.gpu
@torch.no_grad()
def test_compiled_cuda_layers_equal_eager():
    """CUDA: the torch.compile'd norm/rope/residual kernels (+ Triton attention and MoE) give
    the eager torch path's output."""
    model = MoEDecoderModel(MoEDecoderConfig.from_hf(TEXT)).eval()
    widen_(model, seed=7)
    model.cuda()
    T = 37
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(8)).cuda()
    pos = _positions_3d(T).cuda()
    eager, _ = model(x, dense_batch(model, pos))
    configure_kernels(model, KernelOptions(compile=True))
    compiled, _ = model(x, dense_batch(model, pos))
    check_close(compiled, eager, 1e-4, "compiled vs eager")


# ------------------------------------------------------------------------- config
BAD_CONFIGS = [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"intermediate_size": None}, "intermediate_size"),
    ({"rope_parameters": dict(MROPE, mrope_section=[4, 4, 4])}, "mrope_section"),
]


@pytest.mark.parametrize("change,field", BAD_CONFIGS)
def test_unsupported_config_names_the_key(change, field):
    with pytest.raises(ValueError, match=field):
        MoEDecoderModel(MoEDecoderConfig.from_hf(TEXT | change))


def test_sparse_layers_follow_the_config():
    cfg = MoEDecoderConfig.from_hf(TEXT | {"num_hidden_layers": 6, "decoder_sparse_step": 2,
                                           "mlp_only_layers": [3]})
    assert cfg.sparse_layers == (False, True, False, False, False, True)
    assert MoEDecoderConfig.from_hf(TEXT).mrope_interleaved
