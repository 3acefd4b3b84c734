"""A checkpoint's tokenizer, as transformers' `AutoTokenizer.from_pretrained` picks it, without
importing AutoTokenizer where its choice is known from the checkpoint's own files.

Importing AutoTokenizer costs more than the tokenizer: on transformers 5.17 its module pulls in
the auto-model factory, generation utilities, DTensor and FSDP (and sklearn where installed),
about 1.3 s on a CPU and 5+ s on the GPU machines, on every start-up. For a checkpoint whose
tokenizer_config.json names Qwen2's tokenizer, with no remote code, and whose config.json
`model_type` transformers registers Qwen2's tokenizer for (or with no config.json: a diffusers
tokenizer folder), AutoTokenizer takes that class's `from_pretrained`: so do we, directly
(tests/test_tokenizer_loader.py checks the same choice and the same tokenizer against
AutoTokenizer). Any other checkpoint goes through AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnistage.checkpoint import quiet_transformers

# tokenizer_config.json `tokenizer_class` names that resolve to transformers' Qwen2Tokenizer
# (AutoTokenizer strips the "Fast" suffix in transformers 5)
QWEN2_TOKENIZER_NAMES = frozenset({"Qwen2Tokenizer", "Qwen2TokenizerFast"})
# config.json model types that transformers registers Qwen2Tokenizer for: AutoTokenizer then
# takes the class the tokenizer config names (no model-type override applies)
QWEN2_TOKENIZER_MODEL_TYPES = frozenset({"qwen2", "qwen2_5_omni", "qwen3_omni_moe"})


def _json_object(path: Path) -> dict[str, Any] | None:
    """The file's JSON object; None when it is missing or not a JSON object (AutoTokenizer
    then decides, and reports any error itself)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def could_be_hub_id(path: Path) -> bool:
    """Whether the path's text could match an `org/name...` pattern: not when it is absolute,
    starts with "." or has no "/"."""
    text = str(path)
    return not (path.is_absolute() or text.startswith(".") or "/" not in text)


def known_tokenizer_class(path: Path) -> type | None:
    """The tokenizer class AutoTokenizer would load `path` with, where the checkpoint's files
    settle it without AutoTokenizer; None otherwise.

    With a config.json (a model checkpoint), AutoTokenizer first sends some hub ids to its
    generic tokenizers backend, matching the config's name (the path's text) to `org/name-*`
    patterns: settled here only for a path that cannot match one (`could_be_hub_id`). Without
    one (a diffusers `tokenizer/` folder), AutoTokenizer's stand-in config has no model type and
    no name, so the tokenizer config's class is its choice."""
    tokenizer_config = _json_object(path / "tokenizer_config.json")
    if tokenizer_config is None or "auto_map" in tokenizer_config or \
            tokenizer_config.get("tokenizer_class") not in QWEN2_TOKENIZER_NAMES:
        return None
    if (path / "config.json").exists():
        config = _json_object(path / "config.json")
        if could_be_hub_id(path) or config is None or \
                config.get("model_type") not in QWEN2_TOKENIZER_MODEL_TYPES:
            return None
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
    return Qwen2Tokenizer


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint directory's tokenizer (transformers' warnings and progress bars quiet)."""
    path = Path(path)
    tokenizer_class = known_tokenizer_class(path)
    with quiet_transformers():
        if tokenizer_class is not None:
            return tokenizer_class.from_pretrained(str(path))
        from transformers import AutoTokenizer  # (reads config.json through AutoConfig)
        return AutoTokenizer.from_pretrained(str(path))
