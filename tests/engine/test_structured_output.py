"""SamplingParams.structured_output (issue 26): an xgrammar token bitmask applied on the device
before sampling. On random weights (which emit garbage unconstrained), 50 seeded JSON-schema
samples validate with `jsonschema`; greedy output equals transformers' generate with xgrammar's
own HF logits processor; the decode-graph path (cuda_graphs="eager" on CPU, captured on GPU),
with steps launched ahead whose sampler waits for the last tokens, equals the eager path,
logprobs included; EOS only once the JSON is complete."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from omnistage import OmniLLM, SamplingParams
from omnistage.engine.ar.structured_output import GrammarCache, apply_token_bitmask
from omnistage.sampling_params import StructuredOutput

SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "count"], "additionalProperties": False}
CHAT = {"messages": [{"role": "user", "content": "Describe a thing as JSON"}]}


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 64, **kw})


@pytest.fixture(scope="module")
def llm(tiny_qwen2):
    llm = OmniLLM(str(tiny_qwen2), device="cpu")
    yield llm
    llm.shutdown()


def test_bitmask_equals_xgrammar_kernel():
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(0)
    for V in (31, 32, 33, 517):
        logits = torch.randn(5, V, generator=g)
        words = torch.randint(-(1 << 31), 1 << 31, (5, -(-V // 32)), generator=g,
                              dtype=torch.int64).to(torch.int32)
        words[1] = -1  # a row without a grammar
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, words)
        got = apply_token_bitmask(logits, words)
        assert torch.equal(got, want)
        assert torch.equal(got[1], logits[1])


def test_fifty_seeded_samples_validate(llm):
    spec = StructuredOutput(json_schema=SCHEMA)
    params = [_params(temperature=1.0, seed=s, structured_output=spec) for s in range(50)]
    outs = llm.generate([CHAT] * 50, params, use_tqdm=False)
    texts = set()
    for o in outs:
        assert o.error is None and o.stages["llm"].finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
        texts.add(o.text)
    assert len(texts) > 10  # seeded draws, not one answer
    # unconstrained, the same random weights do not emit JSON
    free = llm.generate(CHAT, _params(temperature=1.0, seed=0), use_tqdm=False)[0]
    with pytest.raises(ValueError):
        json.loads(free.text)


def test_greedy_equals_transformers_with_xgrammar_processor(llm, tiny_qwen2):
    from transformers import AutoModelForCausalLM
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor
    spec = StructuredOutput(json_schema=SCHEMA)
    ours = llm.generate(CHAT, _params(temperature=0, structured_output=spec),
                        use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    tok = llm.tokenizer
    prompt = tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    # the reference grammar compiled by xgrammar itself, ending on the checkpoint's EOS ids
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size,
                                              stop_token_ids=eos)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=True, max_whitespace_cnt=4)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                             eos_token_id=eos, logits_processor=[LogitsProcessor(compiled)])
    ref_ids = ref[0, len(prompt):].tolist()
    assert ours.token_ids == ref_ids
    jsonschema.validate(json.loads(ours.text), SCHEMA)


def test_json_object_parses(llm):
    spec = StructuredOutput(json_object=True)
    outs = llm.generate([CHAT] * 8, [_params(temperature=1.0, seed=s, max_tokens=96,
                                             structured_output=spec) for s in range(8)],
                        use_tqdm=False)
    done = [o for o in outs if o.stages["llm"].finish_reason == "stop"]
    assert done
    for o in done:
        assert isinstance(json.loads(o.text), dict)


def test_length_mid_json_and_mixed_batch(llm):
    spec = StructuredOutput(json_schema=SCHEMA)
    cut, free = llm.generate([CHAT, CHAT], [_params(temperature=0, max_tokens=3,
                                                    structured_output=spec),
                                            _params(temperature=0, max_tokens=3)],
                             use_tqdm=False)
    assert cut.stages["llm"].finish_reason == "length" and cut.text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(cut.text)
    # the request without a grammar in the same batch is its own greedy answer
    alone = llm.generate(CHAT, _params(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert free.token_ids == alone.token_ids


@pytest.mark.parametrize("fields,where", [
    ({"structured_output": StructuredOutput(json_schema={"type": "frobnicate"})},
     "structured_output.json_schema"),
    ({"structured_output": StructuredOutput(json_schema="[1, 2]")},
     "structured_output.json_schema"),
    ({"structured_output": StructuredOutput(json_schema={"type": "string",
                                                         "enum": ["x" * 70000]})},
     "structured_output.json_schema"),
    ({"structured_output": StructuredOutput()}, "structured_output"),
    ({"structured_output": StructuredOutput(json_object=True), "ignore_eos": True},
     "ignore_eos"),
    ({"structured_output": StructuredOutput(json_object=True), "min_tokens": 2},
     "min_tokens"),
])
def test_bad_specs_are_named(llm, fields, where):
    with pytest.raises(ValueError, match=rf"sampling_params\[0\]\.{where}:"):
        llm.generate(CHAT, SamplingParams(**fields), use_tqdm=False)


def _matcher_allows(cache: GrammarCache, spec, stops, tokens: list[int]) -> list[np.ndarray]:
    """Per position, the ids an independent xgrammar matcher allows (after tokens[:i])."""
    import xgrammar as xgr
    m = xgr.GrammarMatcher(cache.compile(spec), override_stop_tokens=stops)
    mask = xgr.allocate_token_bitmask(1, cache.vocab_size)
    out = []
    for t in tokens:
        m.fill_next_token_bitmask(mask, 0)
        ids = np.arange(cache.vocab_size)
        words = mask[0].numpy().astype(np.int64) & 0xFFFFFFFF
        out.append(ids[((words[ids >> 5] >> (ids & 31)) & 1) == 1])
        assert m.accept_token(t)
    return out


def _engine_run(tok, device: str, graphs: str, params: list[SamplingParams], prompt: list[int]):
    """(token ids, logprobs) per request through an AREngine on the tiny LM's tokenizer, and
    the engine (its decode graphs' heads)."""
    from omnistage.engine.ar.engine import AREngine
    from omnistage.engine.ar.scheduler import EngineConfig
    from omnistage.engine.ar.sequence import Sequence
    from omnistage.models.layers import DecoderForCausalLM
    from omnistage.testing.tiny_lm import scale_weights_
    torch.manual_seed(0)
    model = DecoderForCausalLM(dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
        max_position_embeddings=4096, tie_word_embeddings=False))
    scale_weights_(model, 0.2)
    model = model.to(device).eval()
    cfg = EngineConfig(max_model_len=256, max_num_seqs=8, block_size=8,
                       max_num_batched_tokens=64, cuda_graphs=graphs)
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    eng = AREngine(model, cfg, torch.device(device), torch.float32, tok, eos)
    for i, p in enumerate(params):
        eng.add_request(Sequence(f"r{i}", list(prompt), p, seed=p.seed or 0))
    ids: dict[str, list[int]] = {}
    lps: dict[str, list[dict]] = {}
    while eng.has_unfinished():
        for u in eng.step():
            assert u.error is None, u.error
            ids.setdefault(u.request_id, []).extend(u.new_token_ids)
            lps.setdefault(u.request_id, []).extend(u.logprobs or [])
    return [(ids[f"r{i}"], lps[f"r{i}"]) for i in range(len(params))], eng, sorted(eos)


def _grammar_params() -> list[SamplingParams]:
    spec = StructuredOutput(json_schema=SCHEMA)
    return [_params(temperature=0.9 if s else 0, seed=s, structured_output=spec, logprobs=5)
            for s in range(5)] + [_params(temperature=0.9, seed=9, logprobs=5)]


def _assert_same(a, b, atol: float) -> None:
    for (ia, la), (ib, lb) in zip(a, b):
        assert ia == ib
        for x, y in zip(la, lb):
            assert x.keys() == y.keys()
            assert np.allclose(list(x.values()), list(y.values()), atol=atol)


def test_graph_path_equals_eager_with_logprobs(llm):
    tok = llm.tokenizer
    prompt = tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    params = _grammar_params()
    eager, _, stops = _engine_run(tok, "cpu", "off", params, prompt)
    graphed, eng, _ = _engine_run(tok, "cpu", "eager", params, prompt)
    assert any(k[1] is not None and k[1].grammar for k in eng.runner.graphs.heads)
    # steps launched ahead (async scheduling): their sampler waited for the last tokens
    assert eng.num_ahead_steps > 0
    _assert_same(eager, graphed, 1e-5)
    cache = GrammarCache(tok, len(tok))
    for (ids, lps), p in zip(eager[:5], params):
        assert json.loads(tok.decode(ids, skip_special_tokens=True)) is not None
        # each position's logprobs list only ids the grammar allows there, and sum to 1 over
        # them when the distribution is that narrow
        allowed = _matcher_allows(cache, p.structured_output, stops, ids)
        for lp, ok in zip(lps, allowed):
            assert set(lp) <= set(ok.tolist())
            if len(ok) <= 5:
                assert np.isclose(np.exp(list(lp.values())).sum(), 1.0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graph_bitmask_equals_eager_gpu(tiny_qwen2):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    prompt = tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    params = _grammar_params()
    graphed, eng, _ = _engine_run(tok, "cuda", "auto", params, prompt)
    assert any(k[1] is not None and k[1].grammar for k in eng.runner.graphs.heads)
    assert eng.num_ahead_steps > 0
    assert eng.runner.graphs.capture  # really captured, not the eager stand-in
    eager, _, _ = _engine_run(tok, "cuda", "off", params, prompt)
    _assert_same(eager, graphed, 1e-4)
    for ids, _ in graphed[:5]:
        jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), SCHEMA)
