"""Prefill graphs (engine/ar/prefill_graphs.py): a one-sequence prefill run through a padded
bucket gives the eager forward's tokens and exported rows, for a plain LM (1-D rope, prefix-cache
hits: prefills that start past 0) and a talker-like model (mrope, replacement + additive rows).
On the CPU this is the cuda_graphs="eager" mode (the same static buffers, no capture);
the GPU test captures the graphs and compares with the CPU."""

import pytest
import torch

from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.prefill_graphs import PrefillGraphs
from omnistage.engine.ar.scheduler import EngineConfig
from omnistage.engine.ar.sequence import Sequence
from omnistage.sampling_params import SamplingParams
from tests.engine.test_cuda_graphs import _models, cpu_model, talker_inputs

# 3 .. 40 tokens: buckets 16, 32, 64; 300 tokens: past the largest bucket (eager); the last
# two share a 24-token prefix (3 blocks of 8), so the second prefill starts at position 24
g = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(0, 280, (n,), generator=g).tolist() for n in (3, 17, 40, 300, 30)]
PROMPTS.append(PROMPTS[-1][:24] + torch.randint(0, 280, (9,), generator=g).tolist())
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.1,
                         max_tokens=6, ignore_eos=True)


def _run(model, device, params, talker: bool, prefill_graphs: bool, budget: int = 512):
    """Each prompt alone (so every prefill is a one-sequence step) -> tokens, exported rows.
    budget: tokens per step (a smaller one chunks the prefills). On the CPU the graphs run in
    the eager mode."""
    cfg = EngineConfig(max_model_len=512, max_num_seqs=4, block_size=8,
                       max_num_batched_tokens=budget, prefill_graphs=prefill_graphs,
                       cuda_graphs="auto" if device.type == "cuda" else "eager")
    eng = AREngine(model, cfg, device, torch.float32)
    assert (eng.runner.prefill_graphs is not None) == prefill_graphs
    tokens, rows = [], []
    for i, p in enumerate(PROMPTS):
        kw = talker_inputs(model, p, i, device) if talker else {}
        seq = Sequence(f"r{i}", p, params, seed=1000 + i, **kw)
        # the last prompt does not export its rows, so it may take prefix-cache hits
        seq.export_hidden = i < len(PROMPTS) - 1
        eng.add_request(seq)
        out, hid = [], []
        while eng.has_unfinished():
            for u in eng.step():
                out.extend(u.new_token_ids)
                if u.hidden is not None:
                    hid.append(u.hidden[1].float().cpu())
        tokens.append(out)
        rows.append(torch.cat(hid) if hid else None)
    return tokens, rows, eng


@pytest.fixture
def graph_runs(monkeypatch):
    """(request id, first position, positions) of every prefill-graph run."""
    calls = []
    real = PrefillGraphs.run

    def run(self, seq, start, n, *args):
        calls.append((seq.request_id, start, n))
        return real(self, seq, start, n, *args)
    monkeypatch.setattr(PrefillGraphs, "run", run)
    return calls


def _same_rows(ref_rows, rows):
    assert sum(r is not None for r in ref_rows) == len(PROMPTS) - 1
    for r, h in zip(ref_rows, rows):
        if r is None:
            assert h is None
            continue
        assert r.shape == h.shape and r.abs().max() > 0.1
        torch.testing.assert_close(h, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("talker", [False, True])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_prefill_graphs_match_eager(graph_runs, talker, params):
    model = cpu_model(talker)
    ref, ref_rows, _ = _run(model, torch.device("cpu"), params, talker, prefill_graphs=False)
    assert not graph_runs
    got, rows, eng = _run(model, torch.device("cpu"), params, talker, prefill_graphs=True)
    pg = eng.runner.prefill_graphs
    # every prompt but the 300-token one; the last one's prefill starts past its cached
    # 24-token prefix (the talker's per-request rows are not cacheable: all 33 positions)
    assert graph_runs == [("r0", 0, 3), ("r1", 0, 17), ("r2", 0, 40), ("r4", 0, 30),
                          ("r5", 0, 33) if talker else ("r5", 24, 9)]
    # the first prefill of a variant (token-only; the talker's: replacement rows) registered
    # every bucket of it, not only the 16/32/64 these prompts use: on the GPU, a bucket first
    # used by a later request would stall it for the capture
    assert pg.buckets == [16, 32, 64, 128, 256]
    assert set(pg.graphs) == {(T, talker, False) for T in pg.buckets}
    assert got == ref
    assert len({t for seq in ref for t in seq}) > 5  # non-trivial output
    _same_rows(ref_rows, rows)


@pytest.mark.parametrize("talker", [False, True])
def test_chunked_prefill_through_graphs(graph_runs, talker):
    # 24-token steps: prompts of 30+ tokens prefill in chunks that start past 0, and only
    # the last chunk samples; the 300-token prompt's chunks fit a bucket too
    model = cpu_model(talker)
    ref, ref_rows, _ = _run(model, torch.device("cpu"), SAMPLED, talker, False, budget=24)
    got, rows, _ = _run(model, torch.device("cpu"), SAMPLED, talker, True, budget=24)
    want = [(f"r{i}", s, min(24, len(p) - s)) for i, p in enumerate(PROMPTS[:5])
            for s in range(0, len(p), 24)]
    want += [("r5", 0, 24), ("r5", 24, 9)] if talker else [("r5", 24, 9)]
    assert graph_runs == want
    assert got == ref
    _same_rows(ref_rows, rows)


def test_buckets_and_bad_sizes():
    model = cpu_model(False)
    eng = AREngine(model, EngineConfig(max_model_len=128, max_num_seqs=2, block_size=8,
                                       cuda_graphs="eager"), torch.device("cpu"), torch.float32)
    pg = eng.runner.prefill_graphs
    assert [pg.bucket(n) for n in (2, 16, 17, 64, 256, 257)] == [16, 16, 32, 64, 256, None]
    seq = Sequence("a", list(range(20)), GREEDY, seed=0)
    assert pg.can_run([seq], [20]) and not pg.can_run([seq], [1])
    assert not pg.can_run([seq, seq], [20, 20]) and not pg.can_run([seq], [300])
    with pytest.raises(ValueError, match="num_tokens"):
        pg.run(seq, 0, 300, torch.arange(300), None, None)
    with pytest.raises(ValueError, match="max_tokens"):
        PrefillGraphs(eng.runner.graphs, max_tokens=8)


@pytest.mark.gpu
@pytest.mark.parametrize("talker", [False, True])
def test_prefill_graphs_gpu_match_cpu(talker):
    ref_model, gpu_model = _models(talker)
    ref, ref_rows, _ = _run(ref_model, torch.device("cpu"), GREEDY, talker, False)
    got, rows, eng = _run(gpu_model, torch.device("cuda"), GREEDY, talker, True)
    pg = eng.runner.prefill_graphs
    assert pg.num_runs == len(PROMPTS) - 1
    # captured on padding rows, every bucket at the variant's first use
    assert set(pg.graphs) == {(T, talker, False) for T in pg.buckets}
    assert got == ref
    _same_rows(ref_rows, rows)


def test_graph_metadata_is_aligned_as_fresh_tensors(graph_runs, monkeypatch):
    # Triton specializes a kernel on its pointers' 16-byte alignment: the graphs' attention
    # metadata (views into one int32 buffer) must be aligned as the eager path's fresh tensors
    # are, or the graphs and a batched eager prefill compile two variants of the kernel
    import omnistage.models.layers as layers
    seen = []
    real = layers.paged_attention

    def spy(q, k_cache, v_cache, meta, scale, **kw):
        seen.append([t.data_ptr() % 16 for t in (meta.query_start_loc, meta.seq_lens,
                                                  meta.block_tables)])
        return real(q, k_cache, v_cache, meta, scale, **kw)

    monkeypatch.setattr(layers, "paged_attention", spy)
    model = cpu_model(False)
    eng = AREngine(model, EngineConfig(max_model_len=128, max_num_seqs=2, block_size=8,
                                       cuda_graphs="eager"), torch.device("cpu"), torch.float32)
    eng.add_request(Sequence("a", PROMPTS[1], GREEDY, seed=0))
    eng.step()
    assert graph_runs == [("a", 0, 17)] and seen
    assert all(offsets == [0, 0, 0] for offsets in seen), seen
