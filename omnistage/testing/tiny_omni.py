"""Tiny random Qwen2.5-Omni checkpoint, built offline in a few seconds (tests and `omnistage demo`).

The checkpoint has the real model's layout: sharded safetensors + index (`thinker.*`, `talker.*`,
`token2wav.*`), tokenizer files with a chat template, `spk_dict.pt` (voices Chelsie and Ethan),
generation_config.json with `<|im_end|>` as eos, and the processor config either as the legacy
merged root `preprocessor_config.json` or as transformers 5's nested `processor_config.json`.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Qwen2_5OmniConfig,
    Qwen2_5OmniForConditionalGeneration,
    Qwen2_5OmniProcessor,
    Qwen2Tokenizer,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnistage.checkpoint import quiet_transformers
from omnistage.testing.video_stub import AcceptsVideoProcessorStub, FrameVideoProcessor

BUILD_VERSION = 1
MARKER = "tiny_omni_build.json"
PROCESSOR_LAYOUTS = ("legacy", "v5")

# Special tokens take ids 0..14, in this order (the real model has them at 151643+).
TINY_OMNI_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>",
    "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>", "<|spk_chelsie|>", "<|spk_ethan|>",
]
TINY_OMNI_IDS = {tok: i for i, tok in enumerate(TINY_OMNI_SPECIALS)}
TINY_THINKER_VOCAB = 1024
TINY_TALKER_EOS = [120, 122]  # tts_codec_pad / tts_codec_end of the tiny talker (real: 8292, 8294)
VOICES = {"Chelsie": "<|spk_chelsie|>", "Ethan": "<|spk_ethan|>"}

_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5-Omni's chat template (same structure and placeholders as the released checkpoint).
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "{% if add_audio_id %}Audio {{ audio_count.value }}: {% endif %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (stdlib text as a tiny English corpus)
    zen = codecs.decode(this.s, "rot13")
    return [zen] * 5 + [Path(os.__file__).read_text(), Path(json.__file__).read_text()]


def build_tiny_tokenizer(vocab_size: int = TINY_THINKER_VOCAB) -> Qwen2Tokenizer:
    """Byte-level BPE with Qwen2's pre-tokenizer, trained offline on stdlib text."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=TINY_OMNI_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    extra = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
             "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
             "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
    out = Qwen2Tokenizer(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token=None, extra_special_tokens=extra)
    out.chat_template = CHAT_TEMPLATE
    return out


def build_tiny_config(tok: PreTrainedTokenizerBase) -> Qwen2_5OmniConfig:
    """Tiny but valid sub-configs (constraints: see /work/shared/DESIGN.md, 'Tiny checkpoints')."""
    i = tok.convert_tokens_to_ids
    hidden = 64  # thinker hidden = audio output_dim = vision out_hidden_size = talker embedding
    ids = dict(audio_token_index=i("<|AUDIO|>"), image_token_index=i("<|IMAGE|>"),
               video_token_index=i("<|VIDEO|>"), audio_start_token_id=i("<|audio_bos|>"),
               audio_end_token_id=i("<|audio_eos|>"), vision_start_token_id=i("<|vision_bos|>"),
               vision_end_token_id=i("<|vision_eos|>"))
    thinker = dict(
        text_config=dict(
            vocab_size=len(tok), hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            # head_dim 16: mrope_section sums to head_dim / 2
            rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                             "mrope_section": [2, 3, 3]}),
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4,
                          encoder_ffn_dim=64, num_mel_bins=128, output_dim=hidden, n_window=100,
                          max_source_positions=1500),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=112, out_hidden_size=hidden, fullatt_block_indexes=[1]),
        user_token_id=tok("user").input_ids[0], **ids)
    talker = dict(
        vocab_size=128, tts_codec_pad_token_id=120, tts_codec_start_token_id=121,
        tts_codec_end_token_id=122, tts_codec_mask_token_id=124,
        tts_text_pad_token_id=i("<|tts_pad|>"), tts_text_start_token_id=i("<|tts_bos|>"),
        tts_text_end_token_id=i("<|tts_eos|>"), embedding_size=hidden, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=4096, spatial_merge_size=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
        **ids)
    dit = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, ff_mult=2,
               emb_dim=16, block_size=24, look_ahead_layers=[1], look_backward_layers=[0],
               repeats=2, num_embeds=128, mel_dim=80, enc_emb_dim=16, enc_dim=16,
               enc_channels=[32, 32, 32, 32, 96], enc_kernel_sizes=[5, 3, 3, 3, 1],
               enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=16, enc_res2net_scale=2,
               enc_se_channels=16)
    bigvgan = dict(mel_dim=80, upsample_initial_channel=64, resblock_kernel_sizes=[3],
                   resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
                   upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])  # x240 -> 24 kHz
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                             token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan))


class _TinyOmniNoVideoProcessor(FrameVideoProcessor):
    """Stands in for Qwen2VLVideoProcessor where video is not wanted: calling it fails."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("video input needs torchvision")


class _TinyOmniProcessor(AcceptsVideoProcessorStub, Qwen2_5OmniProcessor):
    pass


def _feature_extractor() -> WhisperFeatureExtractor:
    # The released checkpoint pads audio to a 300 s window (chunk_length 300), not Whisper's 30 s.
    return WhisperFeatureExtractor(feature_size=128, chunk_length=300, return_attention_mask=True)


def build_tiny_omni_processor(path: str | Path) -> Qwen2_5OmniProcessor:
    """transformers' `Qwen2_5OmniProcessor` for a tiny checkpoint (either processor layout).

    Video is stubbed out (it needs torchvision); text, audio and image work as in transformers.
    """
    path = str(path)
    tok = AutoTokenizer.from_pretrained(path)
    return _TinyOmniProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
        video_processor=_TinyOmniNoVideoProcessor(),
        feature_extractor=WhisperFeatureExtractor.from_pretrained(path),
        tokenizer=tok, chat_template=tok.chat_template)


# Qwen2.5-Omni's video processor settings are Qwen2-VL's: the stand-in's defaults
_TinyOmniFrameVideoProcessor = FrameVideoProcessor


def build_tiny_omni_video_processor(path: str | Path) -> Qwen2_5OmniProcessor:
    """transformers' `Qwen2_5OmniProcessor` with working video: transformers'
    Qwen2VLVideoProcessor (cap_pixels_per_frame=True) where torchvision imports, otherwise
    `_TinyOmniFrameVideoProcessor` (same output, built from the image processor)."""
    try:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
        video_proc: Any = Qwen2VLVideoProcessor(cap_pixels_per_frame=True)
    except ImportError:  # torchvision missing (it does not import beside torch 2.13 CPU)
        video_proc = _TinyOmniFrameVideoProcessor()
    tok = AutoTokenizer.from_pretrained(str(path))
    return _TinyOmniProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(path)),
        video_processor=video_proc,
        feature_extractor=WhisperFeatureExtractor.from_pretrained(str(path)),
        tokenizer=tok, chat_template=tok.chat_template)


def _scale_lm_weights_(module: torch.nn.Module, std: float) -> None:
    # Random LMs at std 0.02 sit near argmax ties; std 0.1 makes greedy decoding stable.
    for m in module.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, 0.0, std)


def _save_processor(out: Path, tok: Qwen2Tokenizer, layout: str) -> None:
    fe, ip = _feature_extractor(), Qwen2VLImageProcessorPil()
    if layout == "legacy":
        tok.save_pretrained(out)
        merged = {**fe.to_dict(), **ip.to_dict(), "image_processor_type": "Qwen2VLImageProcessor",
                  "processor_class": "Qwen2_5OmniProcessor"}
        (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=2) + "\n")
        return
    proc = _TinyOmniProcessor(image_processor=ip, video_processor=_TinyOmniNoVideoProcessor(),
                              feature_extractor=fe, tokenizer=tok, chat_template=CHAT_TEMPLATE)
    proc.save_pretrained(out)
    cfg_path = out / "processor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["processor_class"] = "Qwen2_5OmniProcessor"  # not our test subclass' name
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def is_complete_build(out: Path, marker: str, args: dict[str, Any]) -> bool:
    """Whether `out` holds a finished build for `args` (its marker file records them)."""
    path = out / marker
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()) == args
    except json.JSONDecodeError:
        return False


@contextlib.contextmanager
def staged_build(out: Path, marker: str, args: dict[str, Any],
                 stale: tuple[str, ...] = ()) -> Iterator[Path]:
    """A temporary sibling directory of `out` to write a build into. When the block succeeds
    its files move into `out` (after the marker and the files matching the `stale` glob
    patterns, another build's leftovers, are removed), then the marker recording `args` is
    written: last, so a reader sees a whole build or none. The temporary directory is removed
    either way."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield tmp
        out.mkdir(parents=True, exist_ok=True)
        (out / marker).unlink(missing_ok=True)
        for path in [p for pattern in stale for p in out.glob(pattern)]:
            path.unlink()
        for f in sorted(tmp.iterdir()):
            os.replace(f, out / f.name)
        (out / marker).write_text(json.dumps(args) + "\n")
    finally:
        shutil.rmtree(tmp)


def build_tiny_omni(out_dir: str | Path, seed: int = 0, processor_layout: str = "legacy") -> Path:
    """Build (or reuse) a tiny random Qwen2.5-Omni checkpoint in `out_dir`; returns its path.

    Deterministic for a given seed. A complete build for the same arguments is reused. Files are
    written to a temporary sibling directory first and moved in, the marker file last.
    """
    if processor_layout not in PROCESSOR_LAYOUTS:
        raise ValueError(f"processor_layout must be one of {PROCESSOR_LAYOUTS}, "
                         f"got {processor_layout!r}")
    out = Path(out_dir)
    args = {"version": BUILD_VERSION, "seed": seed, "processor_layout": processor_layout}
    if is_complete_build(out, MARKER, args):
        return out
    # the other processor layout's file is stale
    with staged_build(out, MARKER, args, ("preprocessor_config.json", "processor_config.json")
                      ) as tmp:
        with quiet_transformers():  # its warnings about ids outside the tiny talker vocab
            tok = build_tiny_tokenizer()
            torch.manual_seed(seed)
            model = Qwen2_5OmniForConditionalGeneration(build_tiny_config(tok)).eval()
        with torch.no_grad():
            _scale_lm_weights_(model.thinker.model, 0.1)
            _scale_lm_weights_(model.thinker.lm_head, 0.1)
            _scale_lm_weights_(model.talker, 0.1)
            # transformers' init leaves the waveform near 1e-8; PyTorch's default init gives
            # an RMS of ~0.1-0.3, so comparisons cannot pass on silence.
            for m in model.token2wav.modules():
                if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                    m.reset_parameters()
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        model.generation_config.eos_token_id = [eos]
        model.thinker.generation_config.eos_token_id = [eos]
        with quiet_transformers():
            model.save_pretrained(tmp, max_shard_size="600KB")  # several shards + index
        gen = torch.Generator().manual_seed(seed + 1)
        spk = {name: {"bos_token": tok.convert_tokens_to_ids(token),
                      "cond": torch.randn(1, 16, generator=gen),
                      "ref_mel": torch.randn(1, 64, 80, generator=gen)}
               for name, token in VOICES.items()}
        torch.save(spk, tmp / "spk_dict.pt")
        _save_processor(tmp, tok, processor_layout)
    return out


def tiny_omni_test_messages(seed: int = 0) -> dict[str, list[dict]]:
    """Chat prompts covering each input layout (deterministic media), by case name:
    text_only, audio_text, image_text, audio_image_text, multi_turn, two_images."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    sr = 16000
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(2 * sr) / sr)
            + 0.05 * rng.standard_normal(2 * sr)).astype(np.float32)
    noise = (0.2 * rng.standard_normal(12345)).astype(np.float32)
    img_a = Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8))
    img_b = Image.fromarray(rng.integers(0, 255, (100, 70, 3), dtype=np.uint8))

    return {
        "text_only": [{"role": "user", "content": "Beautiful is better than ugly. Say something."}],
        "audio_text": [user_turn(audio_part(tone), text_part("What do you hear?"))],
        "image_text": [user_turn(image_part(img_a), text_part("What is this?"))],
        "audio_image_text": [user_turn(audio_part(tone), image_part(img_a),
                                       text_part("What do you hear and see?"))],
        "multi_turn": [
            {"role": "system", "content": "Be brief."},
            user_turn(text_part("Listen:"), audio_part(noise)),
            {"role": "assistant", "content": "Static noise."},
            user_turn(image_part(img_b), text_part("And this?"), audio_part(tone)),
        ],
        "two_images": [user_turn(image_part(img_a), image_part(img_b),
                                 text_part("Compare them."))],
    }


# chat message builders (Qwen's content-part convention), for tests
def user_turn(*parts: dict) -> dict:
    return {"role": "user", "content": list(parts)}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def audio_part(audio: Any) -> dict:
    return {"type": "audio", "audio": audio}


def image_part(image: Any) -> dict:
    return {"type": "image", "image": image}


def video_part(video: Any, **options: Any) -> dict:
    """options: e.g. fps."""
    return {"type": "video", "video": video, **options}
