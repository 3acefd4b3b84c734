"""Greedy parity with transformers on tiny random checkpoints (fp32, CPU), under every
scheduling regime: prefix caching on/off, 8-token prefill chunks, a KV cache that preempts."""

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from omnistage import OmniLLM, SamplingParams
from tests.engine.hf_reference import assert_greedy_match, hf_greedy

MAX_NEW = 12


def make_prompts(tokenizer) -> list[list[int]]:
    shared = ("Beautiful is better than ugly. Explicit is better than implicit. Simple is better "
              "than complex. Complex is better than complicated.")
    tails = ["Flat is better", " Sparse is better than dense.", " Readability counts", " Now",
             " Errors should never pass silently.", " In the face of ambiguity"]
    texts = [shared + t for t in tails]
    texts += [shared[:60] + t for t in tails[:3]]  # a second, shorter shared prefix
    texts += ["Hello", "import os", "def main():\n    return 0", "Namespaces are one honking great",
              "x" * 3, "There should be one-- and preferably only one --obvious way to do it.",
              "If the implementation is hard to explain, it's a bad idea."]
    ids = [tokenizer(t).input_ids for t in texts]
    assert len(ids) >= 16 and len({len(i) for i in ids}) >= 8
    return ids


@pytest.fixture(scope="module", params=["tiny_qwen2", "tiny_llama"])
def reference(request):
    path = request.getfixturevalue(request.param)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = make_prompts(tok)
    refs = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    return request.param, path, prompts, refs


CONFIGS = {
    "prefix_cache_on": dict(enable_prefix_caching=True, block_size=8, max_num_seqs=4),
    "prefix_cache_off": dict(enable_prefix_caching=False, block_size=16),
    "chunks_of_8": dict(max_num_batched_tokens=8, block_size=8),
    "small_kv_cache": dict(num_kv_blocks=14, block_size=8, max_model_len=96),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_parity(reference, config):
    name, path, prompts, refs = reference
    llm = OmniLLM(str(path), **CONFIGS[config])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    for i, (out, (ref_ids, scores)) in enumerate(zip(outs, refs)):
        assert out.error is None and out.finished
        assert_greedy_match(out.token_ids, ref_ids, scores, f"{name}/{config}/prompt {i}")
    stats = llm.engine.stats
    assert stats["num_forwards"] == stats["num_steps"]  # one model forward per engine step
    if config in ("prefix_cache_on", "chunks_of_8"):
        assert stats["prefix_cache_hit_tokens"] > 0
    if config == "prefix_cache_off":
        assert stats["prefix_cache_hit_tokens"] == 0
    if config == "small_kv_cache":
        assert stats["num_preemptions"] >= 1
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]  # everything returned at the end
