"""Sampling semantics against transformers' logits processors, and seeded reproducibility."""

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from omnistage import OmniLLM, SamplingParams
from omnistage.engine.ar.sampler import (SamplingTensors, apply_penalties, apply_warpers,
                                         hashed_uniform, sample)
from omnistage.engine.ar.sequence import Sequence
from tests.engine.sampler_reference import host_tensors

V = 50


def make_seqs(params: list[SamplingParams], prompt, outputs) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        s = Sequence(f"r{i}", list(prompt), p, seed=1000 + i)
        s.output_token_ids = list(outputs)
        seqs.append(s)
    return seqs


def hf_probs(logits_row, p: SamplingParams, ids) -> torch.Tensor:
    scores = logits_row[None].clone()
    input_ids = torch.tensor([ids])
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, scores)
    if p.temperature not in (0.0, 1.0):
        scores = TemperatureLogitsWarper(p.temperature)(input_ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(input_ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(input_ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(input_ids, scores)
    return scores.softmax(-1)[0]


PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.8, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05),
    SamplingParams(temperature=1.1, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=0.8),
]


def test_distributions_equal_transformers():
    torch.manual_seed(0)
    logits = torch.randn(len(PARAMS), V) * 3
    prompt, outputs = [1, 2, 3, 7, 7], [9, 3, 11]
    seqs = make_seqs(PARAMS, prompt, outputs)
    t = host_tensors(seqs, V, torch.device("cpu"))
    ours = apply_warpers(apply_penalties(logits.clone(), t), t).softmax(-1)
    for r, p in enumerate(PARAMS):
        ref = hf_probs(logits[r], p, prompt + outputs)
        assert (ref > 0).sum() < V or p.top_k == 0  # the warpers did something where asked
        torch.testing.assert_close(ours[r], ref, atol=1e-6, rtol=1e-5)


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(1, V)
    p = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    seqs = make_seqs([p], [4, 5], [3, 3, 8])
    out = apply_penalties(logits, host_tensors(seqs, V, torch.device("cpu")))[0]
    assert out[3].item() == pytest.approx(-(0.5 + 2 * 0.25))
    assert out[8].item() == pytest.approx(-(0.5 + 0.25))
    assert out[4].item() == 0.0  # prompt ids are not penalised by presence/frequency


def test_draws_follow_the_distribution():
    torch.manual_seed(1)
    base = torch.randn(1, 8)
    n = 20000
    p = SamplingParams(temperature=1.0)
    seqs = [Sequence(f"r{i}", [1], p, seed=i) for i in range(n)]
    t = host_tensors(seqs, 8, torch.device("cpu"))
    tokens = sample(base.expand(n, 8).clone(), t)
    freq = torch.bincount(tokens, minlength=8).float() / n
    assert (freq - base.softmax(-1)[0]).abs().max() < 0.015


def test_hashed_uniform_is_a_function_of_seed_and_step():
    seed = torch.tensor([5, 5, 6], dtype=torch.long)
    step = torch.tensor([0, 0, 0], dtype=torch.long)
    u = hashed_uniform(seed, step, 1000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
    u2 = hashed_uniform(seed, step + 1, 1000)
    assert not torch.equal(u[0], u2[0])


def test_top_hash_value_is_below_one_and_bans_hold():
    """Seed 3502, step 1: token 2178's hash is the largest (2^24 - 1 + 0.5 rounds to 2^24 in
    float32). Its u was exactly 1.0, its Gumbel noise +inf, and with 2178 banned (-inf) the
    score NaN, which argmax drew: Qwen3-Omni's talker emitted a suppressed codec id."""
    V, banned_ids = 3072, [i for i in range(2048, 3072) if i != 2150]
    seed, step = torch.tensor([3502]), torch.tensor([1])
    u = hashed_uniform(seed, step, V)
    assert u.max() < 1 and u[0, 2178] == u.max()
    banned = torch.zeros(1, V, dtype=torch.bool)
    banned[0, banned_ids] = True
    for top_k in (0, 50):
        t = SamplingTensors(
            temperature=torch.tensor([0.9]), top_k=torch.tensor([top_k]),
            top_p=torch.tensor([1.0]), min_p=torch.tensor([0.0]), seed=seed, step=step,
            all_greedy=False, any_top_k=top_k > 0, any_top_p=False, any_min_p=False,
            banned_mask=banned)
        for _ in range(5):
            tok = sample(torch.randn(1, V) * 3, t).item()
            assert tok not in banned_ids


def test_seeded_sampling_same_alone_and_batched(tiny_qwen2):
    llm = OmniLLM(str(tiny_qwen2))
    p = SamplingParams(temperature=1.5, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate("Simple is better than complex.", p, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=1.5, max_tokens=16, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    batch = llm.generate(["Flat is better", "Simple is better than complex.", "Hello", "Now"],
                         [others[0], p, others[1], others[2]], use_tqdm=False)
    assert batch[1].token_ids == alone
    again = llm.generate("Simple is better than complex.", p, use_tqdm=False)[0].token_ids
    assert again == alone
    other_seed = SamplingParams(temperature=1.5, top_p=0.95, max_tokens=16, seed=99,
                                ignore_eos=True)
    assert llm.generate("Simple is better than complex.", other_seed,
                        use_tqdm=False)[0].token_ids != alone
    unseeded = llm.generate("Hello", SamplingParams(temperature=1.0, max_tokens=2),
                            use_tqdm=False)[0]
    assert isinstance(unseeded.metrics.seed, int)


def test_min_tokens_stop_ids_and_stop_strings(tiny_qwen2):
    llm = OmniLLM(str(tiny_qwen2))
    prompt = "Errors should never pass silently."
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0]
    first = greedy.token_ids[0]
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                  stop_token_ids=[first]), use_tqdm=False)[0]
    assert stopped.token_ids == [first] and stopped.stages["llm"].finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=4,
                                               stop_token_ids=[first]), use_tqdm=False)[0]
    assert first not in held.token_ids[:4] and len(held.token_ids) >= 4
    # stop string: cut the text where it first appears
    text = greedy.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              stop=[stop]), use_tqdm=False)[0]
    assert out.text == text[:text.find(stop)]
    assert out.stages["llm"].finish_reason == "stop"


def test_eos_set_and_ignore_eos(tiny_qwen2):
    llm = OmniLLM(str(tiny_qwen2))
    eos = llm.engine.eos_token_ids
    assert llm.tokenizer.eos_token_id in eos and len(eos) >= 1
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 20 and out.stages["llm"].finish_reason == "length"
