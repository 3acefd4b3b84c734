"""tokenizer_loader: the tokenizer AutoTokenizer would load, without importing AutoTokenizer where
the checkpoint settles its choice; and start-up that imports none of transformers' auto-model,
generation or modeling stack (checked in a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from transformers.models.auto.tokenization_auto import (
    TOKENIZER_MAPPING_NAMES,
    tokenizer_class_from_name,
)

from omnistage.testing.tiny_qwen_image import build_tiny_qwen_image_tokenizer
from omnistage.tokenizer_loader import (
    QWEN2_TOKENIZER_MODEL_TYPES,
    QWEN2_TOKENIZER_NAMES,
    known_tokenizer_class,
    load_tokenizer,
)

# what AutoTokenizer's import costs (transformers 5.17 pulls all of these in through it)
HEAVY_MODULES = ("transformers.models.auto.tokenization_auto",
                 "transformers.models.auto.auto_factory", "transformers.generation.utils",
                 "transformers.modeling_utils")
TEXTS = ["Hello, world!", "  spaces\tand\nnewlines 12345 ", "<|im_start|>user\nhi<|im_end|>",
         "ünïcödé 你好 🙂"]


def test_allowlists_match_transformers_registry():
    """Every model type we resolve directly is one transformers registers Qwen2Tokenizer for,
    and every accepted class name resolves to that same class."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
    for model_type in QWEN2_TOKENIZER_MODEL_TYPES:
        assert TOKENIZER_MAPPING_NAMES[model_type].removesuffix("Fast") == "Qwen2Tokenizer"
    for name in QWEN2_TOKENIZER_NAMES:
        assert tokenizer_class_from_name(name.removesuffix("Fast")) is Qwen2Tokenizer


def test_hub_id_patterns_cannot_match_what_we_resolve():
    """AutoTokenizer's hub-id patterns (matched against the config's name, i.e. the path's text)
    all have an "/" and start with neither "/" nor ".": `could_be_hub_id` rules out the rest."""
    from transformers.models.auto.tokenization_auto import MODEL_IDS_TO_TOKENIZERS_BACKEND
    assert MODEL_IDS_TO_TOKENIZERS_BACKEND
    for pattern in MODEL_IDS_TO_TOKENIZERS_BACKEND:
        assert "/" in pattern and not pattern.startswith(("/", ".", "*", "?", "[")), pattern


def assert_same_tokenizer(ours, ref) -> None:
    assert type(ours) is type(ref)
    assert ours.get_vocab() == ref.get_vocab()
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in ref.added_tokens_decoder.items()}
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.chat_template == ref.chat_template
    assert ours.model_max_length == ref.model_max_length
    assert ours.init_kwargs == ref.init_kwargs
    for text in TEXTS:
        assert ours(text)["input_ids"] == ref(text)["input_ids"]
        ids = ref(text)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids)
    if ref.chat_template is not None:
        messages = [{"role": "user", "content": "Hello there"}]
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("fixture", ["tiny_omni_dir", "tiny_qwen3_omni_dir"])
def test_checkpoint_tokenizer_equals_auto_tokenizer(fixture, request):
    path = Path(request.getfixturevalue(fixture)).absolute()
    assert known_tokenizer_class(path) is not None  # the direct path is the one taken
    assert_same_tokenizer(load_tokenizer(path), AutoTokenizer.from_pretrained(str(path)))


def test_diffusers_tokenizer_folder_equals_auto_tokenizer(tmp_path):
    """A diffusers `tokenizer/` folder has no config.json."""
    build_tiny_qwen_image_tokenizer().save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()
    assert known_tokenizer_class(tmp_path) is not None
    assert_same_tokenizer(load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path)))


def _copy_tokenizer(src: Path, dst: Path, tokenizer_config: dict | None = None,
                    config: dict | None = None) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    if tokenizer_config is not None:
        (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_other_checkpoints_go_through_auto_tokenizer(tiny_omni_dir, tiny_qwen2, tiny_llama,
                                                     tmp_path, monkeypatch):
    src = Path(tiny_omni_dir).absolute()
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg = json.loads((src / "config.json").read_text())
    undecided = {
        "auto_map": _copy_tokenizer(src, tmp_path / "a", {**tok_cfg, "auto_map": {
            "AutoTokenizer": ["tok.QwenTok", None]}}),
        "other class": _copy_tokenizer(src, tmp_path / "b", {
            **tok_cfg, "tokenizer_class": "PreTrainedTokenizerFast"}),
        "other model type": _copy_tokenizer(src, tmp_path / "c", config={
            **cfg, "model_type": "llama"}),
        "bad config": _copy_tokenizer(src, tmp_path / "d"),
    }
    (undecided["bad config"] / "config.json").write_text("{not json")
    for why, path in undecided.items():
        assert known_tokenizer_class(path) is None, why
    # a relative path with a "/" may be a hub id AutoTokenizer special-cases; others may not
    monkeypatch.chdir(src.parent.parent)
    assert known_tokenizer_class(Path(src.parent.name) / src.name) is None
    monkeypatch.chdir(src.parent)
    for relative in (Path(src.name), Path("..") / src.parent.name / src.name):
        assert known_tokenizer_class(relative) is not None
        assert_same_tokenizer(load_tokenizer(relative),
                              AutoTokenizer.from_pretrained(str(relative)))
    for lm in (tiny_qwen2, tiny_llama):  # their tokenizer config names no Qwen2Tokenizer
        assert known_tokenizer_class(Path(lm).absolute()) is None
    # the fallback is AutoTokenizer's own answer
    path = undecided["other class"]
    assert_same_tokenizer(load_tokenizer(path), AutoTokenizer.from_pretrained(str(path)))


_STARTUP_SCRIPT = """
import json, sys
from omnistage import OmniLLM
for path in sys.argv[1:]:
    OmniLLM(path, device="cpu").shutdown()
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def test_omni_startup_imports_no_auto_or_modeling_stack(tiny_omni_dir, tiny_qwen3_omni_dir):
    """Constructing the Qwen2.5-Omni and Qwen3-Omni pipelines (fresh process) loads none of
    AutoTokenizer's module, the auto-model factory, generation or modeling utilities."""
    script = _STARTUP_SCRIPT.format(heavy=HEAVY_MODULES)
    out = subprocess.run(
        [sys.executable, "-c", script, str(tiny_omni_dir), str(Path(tiny_qwen3_omni_dir))],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
