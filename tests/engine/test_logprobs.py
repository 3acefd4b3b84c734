"""SamplingParams.logprobs (issue 26): per generated token, the emitted token's logprob and the
top k, on the processed distribution (vLLM's "processed_logprobs"), equal to transformers'
logits processors + log-softmax on the same prompt and tokens (tiny Qwen2, fp32 CPU), through
OmniLLM.generate on the eager path and on the decode-graph path (cuda_graphs="eager"), and
streamed by AsyncOmniLLM. A request without logprobs in the same batch gets none."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import (AutoModelForCausalLM, LogitsProcessorList, MinPLogitsWarper,
                          RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from omnistage import AsyncOmniLLM, OmniLLM, SamplingParams
from omnistage.engine.ar.logprobs import sample_with_logprobs, unpack
from omnistage.engine.ar.sampler import SamplerState, SamplingFlags

TOL = 1e-5
N_NEW = 8


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=N_NEW, ignore_eos=True, **kw)


# (label, params): greedy and seeded sampled requests, k = 0 and k = 5, one without logprobs
CASES = [
    ("greedy_k0", _params(temperature=0, logprobs=0)),
    ("greedy_k5_penalty", _params(temperature=0, repetition_penalty=1.3, logprobs=5)),
    ("sampled_k5", _params(temperature=0.7, top_k=30, top_p=0.9, repetition_penalty=1.1,
                           seed=11, logprobs=5)),
    ("sampled_k0", _params(temperature=1.3, top_p=0.95, seed=5, logprobs=0)),
    ("sampled_k5_top3", _params(temperature=0.9, top_k=3, seed=7, logprobs=5)),
    ("sampled_min_p", _params(temperature=0.8, min_p=0.5, seed=3, logprobs=5)),
    ("no_logprobs", _params(temperature=0.8, seed=1)),
]
PROMPTS = ["Beautiful is better than ugly.", "import os", "Hello", "def main():\n    return 0",
           "Flat is better than nested.", "Readability counts", "Now is better than never."]


@pytest.fixture(scope="module")
def hf_model(tiny_qwen2):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()


def hf_logprobs(model, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """[len(out), V]: transformers' processors on each position's logits, log-softmaxed."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:].float()
    procs = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if not p.greedy:  # greedy: the penalised logits, no temperature (SamplingParams' doc)
        procs.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k > 0:
            procs.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            procs.append(TopPLogitsWarper(p.top_p))
        if p.min_p > 0.0:
            procs.append(MinPLogitsWarper(p.min_p))
    rows = [procs(torch.tensor([prompt + out[:i]]), logits[i:i + 1].clone())[0]
            for i in range(len(out))]
    return torch.stack(rows).log_softmax(dim=-1)


def expected(ref: torch.Tensor, token: int, k: int) -> dict[int, float]:
    d = {token: ref[token].item()}
    values, ids = ref.topk(k)
    for v, i in zip(values.tolist(), ids.tolist()):
        if v != float("-inf"):
            d.setdefault(i, v)
    return d


def check_against_hf(model, outs, label_params, tol: float = TOL) -> None:
    for out, (label, p) in zip(outs, label_params):
        assert out.error is None and len(out.token_ids) == N_NEW, label
        if p.logprobs is None:
            assert out.logprobs is None and out.stages["llm"].logprobs is None, label
            continue
        assert len(out.logprobs) == len(out.token_ids), label
        assert out.stages["llm"].logprobs == out.logprobs
        ref = hf_logprobs(model, out.prompt_token_ids, out.token_ids, p)
        for i, (tok, got) in enumerate(zip(out.token_ids, out.logprobs)):
            want = expected(ref[i], tok, p.logprobs)
            assert next(iter(got)) == tok, f"{label}[{i}]: the emitted token comes first"
            assert set(got) == set(want), f"{label}[{i}]: {got} vs {want}"
            for t, v in want.items():
                assert abs(got[t] - v) < tol, f"{label}[{i}] token {t}: {got[t]} vs {v}"
            assert got[tok] > float("-inf")  # drawn from the kept set
            if p.logprobs == 0:
                assert len(got) == 1


@pytest.mark.parametrize("graphs", ["off", "eager"])
def test_logprobs_match_transformers(tiny_qwen2, hf_model, graphs):
    llm = OmniLLM(str(tiny_qwen2), max_model_len=128, cuda_graphs=graphs)
    outs = llm.generate(PROMPTS, [p for _, p in CASES], use_tqdm=False)
    check_against_hf(hf_model, outs, CASES)
    top3 = outs[[label for label, _ in CASES].index("sampled_k5_top3")]
    assert all(len(d) <= 3 for d in top3.logprobs)  # cut tokens (-inf) are not listed
    assert any(len(d) == 3 for d in top3.logprobs)
    eng = llm.engine
    if graphs == "eager":  # decodes drew (and took logprobs) in the graph head, some ahead
        assert any(key[2] for key in eng.runner.graphs.heads)
        assert eng.stats["num_ahead_steps"] > 0
    llm.shutdown()


def test_graph_path_equals_eager_path(tiny_qwen2):
    # the same seeded requests give the same tokens and logprobs on both paths
    runs = []
    for graphs in ("off", "eager"):
        llm = OmniLLM(str(tiny_qwen2), max_model_len=128, cuda_graphs=graphs)
        outs = llm.generate(PROMPTS[:6], [p for _, p in CASES[:6]], use_tqdm=False)
        runs.append([(o.token_ids, o.logprobs) for o in outs])
        llm.shutdown()
    for (ids_a, lp_a), (ids_b, lp_b) in zip(*runs):
        assert ids_a == ids_b
        for a, b in zip(lp_a, lp_b):
            assert list(a) == list(b) and all(abs(a[t] - b[t]) < TOL for t in a)


def test_streamed_logprobs_come_with_each_delta(tiny_qwen2):
    params = _params(temperature=0.7, top_k=30, seed=2, logprobs=2, stop=["e"])

    async def main():
        async with AsyncOmniLLM(str(tiny_qwen2), max_model_len=128) as llm:
            return [out async for out in llm.generate("Hello there", params)]

    outs = asyncio.run(main())
    assert len(outs) > 2
    final = outs[-1]
    assert final.finished and final.error is None
    assert len(final.logprobs) == len(final.token_ids)
    streamed = [d for o in outs for d in o.logprobs_delta]
    assert streamed == final.logprobs
    for o in outs:  # cumulative, aligned with token_ids
        assert len(o.logprobs) == len(o.token_ids)
        assert [next(iter(d)) for d in o.logprobs] == o.token_ids


@pytest.mark.gpu
def test_captured_graph_logprobs_on_cuda(tiny_qwen2, hf_model):
    """fp32 on CUDA: captured decode graphs (logprobs inside the head graph, Triton draws)
    give transformers' values and the CPU eager path's tokens."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        llm = OmniLLM(str(tiny_qwen2), max_model_len=128, device="cuda", dtype="float32")
        outs = llm.generate(PROMPTS, [p for _, p in CASES], use_tqdm=False)
        heads = llm.engine.runner.graphs.heads
        assert llm.engine.runner.graphs.capture
        assert any(key[2] and g is not None for key, g in heads.items())  # captured
        llm.shutdown()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    check_against_hf(hf_model, outs, CASES, tol=1e-4)
    cpu = OmniLLM(str(tiny_qwen2), max_model_len=128, cuda_graphs="off")
    ref = cpu.generate(PROMPTS, [p for _, p in CASES], use_tqdm=False)
    for a, b, (label, p) in zip(outs, ref, CASES):
        if p.seed is not None:
            assert a.token_ids == b.token_ids, label


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "5"])
def test_bad_logprobs_is_a_value_error(tiny_qwen2, value):
    with pytest.raises(ValueError, match=r"^sampling_params\.logprobs: "):
        SamplingParams(logprobs=value).validate()
    llm = OmniLLM(str(tiny_qwen2), max_model_len=128)
    with pytest.raises(ValueError, match=r"sampling_params.*\.logprobs"):
        llm.generate(["fine", "also fine"], [SamplingParams(), SamplingParams(logprobs=value)],
                     use_tqdm=False)
    assert llm.engine.num_steps == 0
    llm.shutdown()


@pytest.mark.parametrize("seed,k", [(0, 5), (1, 0)])
def test_triton_draw_with_logprobs(seed, k):
    """The Triton path (TRITON_INTERPRET on CPU) draws the reference's tokens and its rows'
    logprobs equal the reference's; a sampled row's token is in its kept set."""
    g = torch.Generator().manual_seed(seed)
    S, V, N = 8, 64, 6
    st = SamplerState(S, V, torch.device("cpu"))
    st.fparams[:S, 0] = torch.tensor([0.0, 0.7, 1.2, 0.9, 0.0, 1.0])[torch.arange(S) % 6]
    st.fparams[:S, 1] = 0.9  # top-p
    st.fparams[:S, 3] = 1.2  # repetition penalty
    st.iparams[:S, 0] = 10  # top-k
    st.iparams[:S, 1] = torch.randint(0, 2**62, (S,), generator=g)
    st.counts[:S] = (torch.rand(S, V, generator=g) < 0.1).float()
    slots, steps = torch.arange(N), torch.randint(0, 9, (N,), generator=g)
    logits = torch.randn(N, V, generator=g) * 3
    flags = SamplingFlags(False, True, True, False, True, False)
    rows = torch.tensor([1, 2, 4])
    counts = st.counts.clone()
    ref, ref_lp = sample_with_logprobs(st, logits, slots, steps, None, flags, rows, k,
                                       fast=False)
    st.counts = counts
    got, got_lp = sample_with_logprobs(st, logits, slots, steps, None, flags, rows, k,
                                       fast=True)
    assert got.tolist() == ref.tolist()
    assert torch.equal(got_lp, ref_lp)
    assert got_lp.shape == (3, 1 + 2 * k)
    lps = unpack(got_lp.numpy(), got[rows].tolist(), [k] * 3)
    for d, tok in zip(lps, got[rows].tolist()):
        assert next(iter(d)) == tok and d[tok] > float("-inf") and len(d) <= k + 1
