"""Abort frees blocks; bad input fails before any work starts, naming the field."""

import pytest

from omnistage import OmniLLM, SamplingParams
from omnistage.engine.ar.sequence import Sequence


def test_abort_returns_every_block(tiny_qwen2):
    llm = OmniLLM(str(tiny_qwen2), block_size=8)
    llm.shutdown()  # drive the engine by hand, without the runtime's loop
    engine = llm.engine
    free_at_start = engine.blocks.num_free_blocks
    tok = llm.tokenizer
    for i in range(4):
        ids = tok("Beautiful is better than ugly. " * (i + 1)).input_ids
        p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        engine.add_request(Sequence(f"r{i}", ids, p, seed=0))
    for _ in range(5):
        engine.step()
    assert engine.blocks.num_free_blocks < free_at_start
    assert engine.abort("r1") and engine.abort("r3")
    for _ in range(3):
        engine.step()
    assert engine.abort("r0") and engine.abort("r2")
    assert not engine.abort("r0")  # already gone
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == free_at_start
    assert all(c == 0 for c in engine.blocks.ref_count)


BAD = [
    ("", None, "prompts[1]"),
    ("x " * 200, None, "prompts[1]"),
    ("ok", SamplingParams(max_tokens=0), "max_tokens"),
    ("ok", SamplingParams(temperature=-0.5), "temperature"),
    ("ok", SamplingParams(top_p=0.0), "top_p"),
    ("ok", SamplingParams(top_p=1.5), "top_p"),
    ("ok", {"talker": SamplingParams()}, "unknown stage 'talker'"),
    ({"prompt_token_ids": [1, 10**9]}, None, "prompts[1].prompt_token_ids"),
    ({"prompt": "a", "typo": 1}, None, "prompts[1]: unknown key"),
]


@pytest.mark.parametrize("prompt,params,field", BAD)
def test_bad_input_is_a_value_error_before_work(tiny_qwen2, prompt, params, field):
    llm = OmniLLM(str(tiny_qwen2), max_model_len=128)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    assert llm.engine.num_steps == 0 and not llm.engine.has_unfinished()


def test_missing_model_path_and_bad_options(tiny_qwen2):
    with pytest.raises(ValueError, match="model"):
        OmniLLM("/nonexistent/checkpoint")
    with pytest.raises(ValueError, match="device"):
        OmniLLM(str(tiny_qwen2), device="tpu")
    with pytest.raises(ValueError, match="dtype"):
        OmniLLM(str(tiny_qwen2), dtype="int3")
    with pytest.raises(ValueError, match="max_num_seqs"):
        OmniLLM(str(tiny_qwen2), max_num_seqs=-1)


def test_engine_switches_from_options_and_stage_yaml(tiny_qwen2):
    # constructor options reach the engine's config; the runner reads them once at build
    llm = OmniLLM(str(tiny_qwen2), max_model_len=128, cuda_graphs="eager",
                  async_scheduling=False, prefill_graphs=False, ar_stream="ar")
    eng = llm.engine
    assert eng.config.cuda_graphs == "eager" and eng.runner.graphs is not None
    assert not eng.async_scheduling and eng.runner.prefill_graphs is None
    assert eng.config.ar_stream == "ar" and eng.config.fast_sampler  # the rest: defaults
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].token_ids) == 4
    with pytest.raises(ValueError, match="cuda_graphs"):
        OmniLLM(str(tiny_qwen2), cuda_graphs="sometimes")
    with pytest.raises(ValueError, match="pdl"):
        OmniLLM(str(tiny_qwen2), pdl="no")


def test_engine_config_switches_and_stage_keys():
    from pydantic import ValidationError

    from omnistage.config.schema import EngineOptions
    from omnistage.engine.ar.scheduler import engine_config
    cfg = engine_config(4096)
    assert (cfg.cuda_graphs, cfg.compile, cfg.pdl, cfg.ar_stream) == ("auto", True, True, None)
    # a stage's YAML `engine:` keys: unset ones (None) leave the constructor's value
    stage = EngineOptions(cuda_graphs="eager", triton_gemv=False)
    cfg = engine_config(4096, **{"cuda_graphs": "off", "pdl": False,
                                 **stage.model_dump(exclude_none=True)})
    assert (cfg.cuda_graphs, cfg.pdl, cfg.triton_gemv, cfg.compile) == ("eager", False, False,
                                                                        True)
    with pytest.raises(ValidationError):
        EngineOptions(cuda_graphs="1")
    with pytest.raises(ValidationError):
        EngineOptions(cuda_graph="off")  # unknown keys stay forbidden
