"""Async scheduling: decode steps launched before the previous step's tokens are read (their
input ids copied on the device) give the same tokens, finish reasons and exported rows as the
plain eager path; a request that stops on EOS, is aborted, or waits on input rows is handled.
The decode-graph path runs uncaptured on the CPU (EngineConfig.cuda_graphs="eager")."""

from __future__ import annotations

import pytest
import torch

from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.scheduler import EngineConfig
from omnistage.engine.ar.sequence import Sequence
from omnistage.models.layers import DecoderForCausalLM
from omnistage.models.qwen2_5_omni.talker import Qwen2_5OmniTalkerForCausalLM
from omnistage.sampling_params import SamplingParams
from omnistage.testing.input_rows import RandomInputRows
from omnistage.testing.tiny_lm import scale_weights_
from tests.engine.test_cuda_graphs import LM_CFG, TALKER_CFG

EOS = {5, 7, 11, 13}  # frequent enough that random weights stop some requests early


def _model(talker: bool = False):
    torch.manual_seed(0)
    m = Qwen2_5OmniTalkerForCausalLM(TALKER_CFG) if talker else DecoderForCausalLM(LM_CFG)
    scale_weights_(m, 0.2)
    return m.eval()


def _engine(model, graphs: str, max_num_seqs: int = 8, **switches) -> AREngine:
    cfg = EngineConfig(max_model_len=256, max_num_seqs=max_num_seqs, block_size=8,
                       max_num_batched_tokens=64, cuda_graphs=graphs, **switches)
    eng = AREngine(model, cfg, torch.device("cpu"), torch.float32, eos_token_ids=EOS)
    assert (eng.runner.graphs is not None) == (graphs == "eager")
    return eng


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(20, 280, (3 + 5 * i,), generator=g).tolist() for i in range(n)]


def _drain(eng: AREngine, out: dict, hidden: dict | None = None, on_step=None) -> None:
    while eng.has_unfinished():
        if on_step is not None:
            on_step(eng)
        for u in eng.step():
            out.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.hidden is not None and hidden is not None:
                hidden.setdefault(u.request_id, []).append((u.hidden[0], u.hidden[1].clone()))
            if u.finished:
                out[u.request_id].append(u.finish_reason)


@pytest.mark.parametrize("sampled", [False, True])
def test_steps_ahead_give_the_eager_tokens(sampled):
    model = _model()

    def run(graphs: str):
        eng = _engine(model, graphs)
        for i, p in enumerate(_prompts(6)):
            params = SamplingParams(temperature=0.8 if sampled else 0, top_k=20,
                                    repetition_penalty=1.1, max_tokens=24 + 3 * i,
                                    min_tokens=2 if i == 1 else 0)
            forced = [40 + j for j in range(10)] if i == 2 else None
            eng.add_request(Sequence(f"r{i}", p, params, seed=i, forced_output_ids=forced,
                                     export_hidden=i == 3))
        out, hidden = {}, {}
        _drain(eng, out, hidden)
        return out, hidden, eng

    ref, ref_hidden, ref_eng = run("off")
    got, got_hidden, eng = run("eager")
    assert ref_eng.num_ahead_steps == 0
    assert eng.num_ahead_steps > eng.num_steps // 2, eng.stats
    assert got == ref
    reasons = [o[-1] for o in ref.values()]
    assert "stop" in reasons and "length" in reasons  # EOS mid-run and max_tokens both seen
    assert ref["r2"][:-1] == [40 + j for j in range(10)]
    assert len({t for o in ref.values() for t in o[:-1]}) > 10  # non-trivial output
    # exported rows: same positions (no gaps, none repeated) and values
    pos = [p for p, _ in got_hidden["r3"]]
    assert pos == [p for p, _ in ref_hidden["r3"]] and pos == sorted(set(pos))
    for (_, a), (_, b) in zip(ref_hidden["r3"], got_hidden["r3"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


class _GatedRows(RandomInputRows):
    """Rows become ready a few at a time (as the thinker's rows reach the talker)."""

    def __init__(self, prompt_len: int, width: int, seed: int) -> None:
        super().__init__(prompt_len, width, seed, torch.device("cpu"))
        self.available = prompt_len

    def ready(self, seq) -> int:
        return self.available


def test_talker_rows_gate_the_step_ahead():
    model = _model(talker=True)
    width = model.model.embed_tokens.weight.shape[1]
    params = SamplingParams(temperature=0.9, top_p=0.8, repetition_penalty=1.05, max_tokens=30,
                            ignore_eos=True)

    def run(graphs: str, gated: bool):
        eng = _engine(model, graphs)
        sources = []
        for i, p in enumerate(_prompts(4)):
            src = _GatedRows(len(p), width, i) if gated else RandomInputRows(
                len(p), width, i, torch.device("cpu"))
            sources.append(src)
            eng.add_request(Sequence(
                f"r{i}", p, params, seed=100 + i, input_source=src, cacheable=False,
                mrope_positions=torch.arange(len(p)).expand(3, -1) * torch.tensor([[1], [2], [3]]),
                rope_delta=5))

        def feed(_eng):  # every third step, each request gains 2 rows
            feed.calls += 1
            if feed.calls % 3 == 0:
                for s in sources:
                    if isinstance(s, _GatedRows):
                        s.available += 2
        feed.calls = 0
        out = {}
        _drain(eng, out, on_step=feed)
        return out, eng

    ref, _ = run("off", gated=False)
    got, eng = run("eager", gated=True)
    assert got == ref
    assert all(len(o) == 31 for o in got.values())
    # rows gate some steps ahead (they need the next position's row) but not all of them
    assert 0 < eng.num_ahead_steps < eng.num_steps - 4, eng.stats


def test_abort_with_a_step_ahead():
    model = _model()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def run(abort: bool):
        eng = _engine(model, "eager")
        for i, p in enumerate(_prompts(3)):
            eng.add_request(Sequence(f"r{i}", p, params, seed=0))
        out = {}
        for _ in range(6):
            for u in eng.step():
                out.setdefault(u.request_id, []).extend(u.new_token_ids)
        assert eng._ahead is not None  # a step is in flight past the collected one
        if abort:
            assert eng.abort("r1")
            out.pop("r1")
        _drain(eng, out)
        return out, eng

    ref, _ = run(abort=False)
    got, eng = run(abort=True)
    assert set(got) == {"r0", "r2"}
    assert got["r0"] == ref["r0"] and got["r2"] == ref["r2"]
    assert not eng.has_unfinished()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert all(c == 0 for c in eng.blocks.ref_count)

    # aborting every request drops the step ahead (nothing of it is left to collect)
    eng = _engine(model, "eager")
    for i, p in enumerate(_prompts(2)):
        eng.add_request(Sequence(f"r{i}", p, params, seed=0))
    for _ in range(4):
        eng.step()
    assert eng._ahead is not None
    assert eng.abort("r0") and eng.abort("r1")
    assert not eng.has_unfinished()


def test_async_scheduling_off():
    eng = _engine(_model(), "eager", async_scheduling=False)
    eng.add_request(Sequence("r", _prompts(1)[0],
                             SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), seed=0))
    out = {}
    _drain(eng, out)
    assert len(out["r"]) == 9 and eng.num_ahead_steps == 0


def test_switches_are_validated():
    with pytest.raises(ValueError, match="cuda_graphs"):
        AREngine(_model(), EngineConfig(max_model_len=64, max_num_seqs=2, cuda_graphs="yes"),
                 torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="0").validate()
    with pytest.raises(ValueError, match="ar_stream"):
        EngineConfig(ar_stream="").validate()
