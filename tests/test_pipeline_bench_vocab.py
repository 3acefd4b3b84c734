"""The GPU pipeline benchmark's random 7B checkpoint gets the tiny tokenizer's files with the
vocab filled up to the real size (benchmarks/qwen2_5_omni_pipeline_gpu.py: fill_vocab), so
that every id random weights sample decodes to text while prompts encode as before."""

from __future__ import annotations

import shutil

import torch
from transformers import Qwen2Tokenizer

from benchmarks.qwen2_5_omni_pipeline_gpu import fill_vocab

REAL_VOCAB = 152064
MESSAGES = [{"role": "system", "content": "You are Qwen."},
            {"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]


def test_every_id_decodes_to_text_and_prompts_encode_as_before(tiny_omni_dir, tmp_path):
    for f in tiny_omni_dir.iterdir():  # the tokenizer's files, as the benchmark copies them
        if f.is_file() and f.suffix in (".json", ".jinja", ".txt") and "config.json" != f.name:
            shutil.copy(f, tmp_path / f.name)
    before = Qwen2Tokenizer.from_pretrained(tmp_path)
    added = fill_vocab(tmp_path / "tokenizer.json", REAL_VOCAB)
    after = Qwen2Tokenizer.from_pretrained(tmp_path)
    assert added == REAL_VOCAB - len(before) > 150_000
    assert len(after) == REAL_VOCAB
    prompt = before.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert after(prompt)["input_ids"] == before(prompt)["input_ids"]
    assert after.all_special_ids == before.all_special_ids
    ids = torch.randint(0, REAL_VOCAB, (256,), generator=torch.Generator().manual_seed(0))
    # before: nearly every random id decoded to nothing
    assert sum(bool(before.decode([i])) for i in ids.tolist()) < 16
    texts = [after.decode([i]) for i in ids.tolist()]
    assert all(texts), [i for i, t in zip(ids.tolist(), texts) if not t]
    high = next(i for i in ids.tolist() if i >= len(before))
    assert after.decode([high]) == f"<|filler_{high}|>"
