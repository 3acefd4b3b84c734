"""Tensor parallelism inside an AR stage (CPU, gloo, worker ranks in spawned processes):
TP=2 and TP=4 give TP=1's greedy tokens for a tiny Qwen2 LM, the tiny Qwen2.5-Omni thinker (a
prompt with audio: encoder rows travel in the step messages) and the tiny Qwen3-Omni thinker
(MoE, experts split by intermediate size), through the stage builder (runtime/build.py).

Near-tie rule: a token may differ from TP=1's only where TP=1's own top-2 logit gap is below
1e-4 (after that the two continuations are not comparable). Router-gap rule: an MoE layer may
choose other experts than TP=1 only where TP=1's k-th and (k+1)-th router logits are within
1e-4. Each rank's parameters are asserted to be its 1/TP share (KV projections: 1/min(TP, KV
heads), the KV heads being replicated beyond that) and its KV cache likewise.

The worker processes stay in a pool between tests (engine/ar/tp_workers.py), so the module
spawns 3."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from omnistage.checkpoint import load_config
from omnistage.config.schema import load_pipeline
from omnistage.engine.ar.sequence import Sequence
from omnistage.engine.ar.tp_workers import check_devices, rank_report
from omnistage.layers.moe import SparseMoE
from omnistage.layers.parallel import TensorParallel, head_layout, split, tensor_parallel
from omnistage.runtime.build import StagePlacement, build_stage_worker
from omnistage.sampling_params import SamplingParams

MAX_TOKENS = 6
NEAR_TIE = 1e-4
CPU = torch.device("cpu")


# ------------------------------------------------------------------------- harness
def run_stage(path, pipeline: str, stage: str, tp: int, make_seqs, graphs: str = "off",
              record_router: bool = False, devices: tuple[str, ...] | None = None,
              quantization: str | None = None, all_reduce: str | None = None) -> dict:
    """Build `stage` of `pipeline` with `tp` ranks (on `devices`, default all CPU) through the
    stage builder, run the sequences make_seqs(worker) to the end; tokens, logprobs, every
    rank's report and (MoE) the router logits of rank 0, call by call. all_reduce: the
    tp_all_reduce engine option (None: its default)."""
    devices = devices or ("cpu",) * tp
    config = load_config(path)
    # (compile off: inductor's cold compile per rank outlasts a GPU test; graphs still capture)
    engine = {"cuda_graphs": graphs, "max_model_len": 512, "max_num_seqs": 4,
              "async_scheduling": True, "compile": False}
    if all_reduce is not None:
        engine["tp_all_reduce"] = all_reduce
    options = {"engine": engine, "stage_worker": None, "load_format": "safetensors",
               "quantization": quantization}
    worker = build_stage_worker(path, config, load_pipeline(pipeline), stage,
                                torch.device(devices[0]), torch.float32, options,
                                StagePlacement(0, devices, tp))
    engine = worker.engine
    runner = engine.runner
    try:
        router: list[tuple[int, torch.Tensor]] = []
        if record_router:
            for m in runner.model.modules():
                if isinstance(m, SparseMoE):
                    m.gate.register_forward_hook(
                        lambda mod, inp, out: router.append((runner.num_forwards,
                                                             out.detach().clone())))
        seqs = make_seqs(worker)
        for s in seqs:
            engine.add_request(s)
        tokens = {s.request_id: [] for s in seqs}
        logprobs = {s.request_id: [] for s in seqs}
        while engine.has_unfinished():
            for u in engine.step():
                tokens[u.request_id] += u.new_token_ids
                logprobs[u.request_id] += u.logprobs or []
        reports = [rank_report(0, runner)]
        if runner.tp_workers is not None:
            reports += runner.tp_workers.reports
            assert runner.tp_workers.reports and all(
                r.num_kv_blocks == runner.num_blocks for r in reports)
        whole = {n: p.tp_shard.full_shape for n, p in runner.model.named_parameters()
                 if getattr(p, "tp_shard", None) is not None}
        return {"tokens": tokens, "logprobs": logprobs, "reports": reports, "router": router,
                "all_reduce_mode": runner.tp.all_reduce_mode,
                "symm_calls": runner.tp.symm.num_calls if runner.tp.symm is not None else 0,
                "fp8_layers": sum(getattr(m, "fp8", None) is not None
                                  for m in runner.model.modules()),
                "fp8_experts": sum(bool(getattr(m, "is_fp8", False))
                                   for m in runner.model.modules()),
                "ahead": engine.num_ahead_steps, "graph_forwards": len(runner.graphs.graphs)
                if runner.graphs is not None else 0,
                "graph_runs": runner.graphs.num_runs if runner.graphs is not None else 0,
                "whole": whole, "num_kv_heads": runner.model.config.num_key_value_heads}
    finally:
        runner.close()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2,
                          **kw)


def first_divergence(ref: dict, got: dict) -> dict[str, int | None]:
    """Per request: None (identical tokens) or the index of a divergence allowed by the
    near-tie rule; fails on any other difference."""
    out = {}
    for rid, want in ref["tokens"].items():
        have = got["tokens"][rid]
        assert len(have) == len(want), (rid, want, have)
        out[rid] = None
        for i, (a, b) in enumerate(zip(want, have)):
            if a != b:
                top = sorted(ref["logprobs"][rid][i].values(), reverse=True)
                gap = top[0] - top[1]
                assert gap < NEAR_TIE, (f"{rid}: token {i} is {b}, TP=1 gave {a} with a top-2 "
                                        f"gap of {gap:.2e} (not a near-tie)")
                out[rid] = i
                break
    return out


def assert_shares(ref: dict, got: dict, tp: int) -> None:
    """Each rank holds 1/TP of every sharded parameter (k/v: 1/min(TP, KV heads); the vocab
    padded up to a multiple of TP) and 1/min(TP, KV heads) of the KV cache per block."""
    kv = got["num_kv_heads"]
    ref_shapes = ref["reports"][0].param_shapes
    assert len(got["reports"]) == tp and sorted(r.rank for r in got["reports"]) == list(range(tp))
    assert got["whole"], "no parameter is sharded"
    for report in got["reports"]:
        assert report.param_shapes.keys() == ref_shapes.keys()
        for name, shape in report.param_shapes.items():
            whole = got["whole"].get(name)
            if whole is None:  # replicated (norms, routers, encoders)
                assert shape == ref_shapes[name], name
                continue
            assert tuple(whole) == ref_shapes[name], name
            diff = [d for d, (a, b) in enumerate(zip(shape, whole)) if a != b]
            assert len(diff) == 1, (name, shape, whole)
            d = diff[0]
            share = min(tp, kv) if name.endswith(("k_proj.weight", "v_proj.weight",
                                                  "k_proj.bias", "v_proj.bias")) else tp
            assert shape[d] == -(-whole[d] // share), (name, shape, whole, share)
        layers, heads, hd = ref["reports"][0].kv_shape
        assert report.kv_shape == (layers, heads // min(tp, kv), hd)
        assert report.kv_bytes_per_block * min(tp, kv) == ref["reports"][0].kv_bytes_per_block


def assert_router_close(ref: dict, got: dict, diverged: dict) -> None:
    """Router-gap rule over every MoE call before any token diverged."""
    stop = min([i for i in diverged.values() if i is not None], default=None)
    assert len(ref["router"]) == len(got["router"]) and ref["router"]
    checked = 0
    for (step, a), (_, b) in zip(ref["router"], got["router"]):
        if stop is not None and step >= stop:  # (prefill is step 0: an upper bound)
            break
        assert a.shape == b.shape
        k = 2
        top_a, top_b = a.topk(k + 1, dim=-1), b.topk(k, dim=-1)
        for row in range(a.shape[0]):
            if set(top_a.indices[row, :k].tolist()) != set(top_b.indices[row].tolist()):
                gap = float(top_a.values[row, k - 1] - top_a.values[row, k])
                assert gap < NEAR_TIE, f"step {step} row {row}: other experts, gap {gap:.2e}"
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked


# ------------------------------------------------------------------------- tiny Qwen2
def qwen2_seqs(worker) -> list[Sequence]:
    return [Sequence("a", [1, 2, 3, 4, 5, 6, 7], greedy(), 0),
            Sequence("b", [9, 8, 7], greedy(), 1)]


@pytest.fixture(scope="module")
def qwen2_ref(tiny_qwen2):
    return run_stage(tiny_qwen2, "llm", "llm", 1, qwen2_seqs)


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen2_tp_matches_tp1(tiny_qwen2, qwen2_ref, tp):
    got = run_stage(tiny_qwen2, "llm", "llm", tp, qwen2_seqs)
    first_divergence(qwen2_ref, got)
    assert_shares(qwen2_ref, got, tp)


def test_qwen2_tp_graph_path(tiny_qwen2, qwen2_ref):
    """The decode graphs' path (uncaptured on CPU): graph step messages, steps launched
    ahead with rank 0's sampled ids, the logits gathered inside the forward."""
    got = run_stage(tiny_qwen2, "llm", "llm", 2, qwen2_seqs, graphs="eager")
    first_divergence(qwen2_ref, got)
    assert got["graph_forwards"] and got["ahead"] > 0


# ------------------------------------------------------------------------- omni thinkers
def omni_seqs(processor_cls, seq_fn):
    from omnistage.testing.tiny_omni import tiny_omni_test_messages

    def make(worker) -> list[Sequence]:
        path = make.path
        proc = processor_cls.from_pretrained(path)
        msgs = tiny_omni_test_messages()
        return [seq_fn(f"{case}", proc.process(msgs[case]), greedy(), 3)
                for case in ("text_only", "audio_text")]
    return make


@pytest.fixture(scope="module")
def omni_case(tiny_omni_dir):
    from omnistage.models.qwen2_5_omni.processor import Qwen2_5OmniInputProcessor
    from omnistage.models.qwen2_5_omni.thinker import thinker_sequence
    make = omni_seqs(Qwen2_5OmniInputProcessor, thinker_sequence)
    make.path = tiny_omni_dir
    return make, run_stage(tiny_omni_dir, "qwen2_5_omni", "thinker", 1, make)


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen2_5_omni_thinker_tp_matches_tp1(tiny_omni_dir, omni_case, tp):
    make, ref = omni_case
    got = run_stage(tiny_omni_dir, "qwen2_5_omni", "thinker", tp, make)
    first_divergence(ref, got)
    assert_shares(ref, got, tp)


@pytest.fixture(scope="module")
def qwen3_case(tiny_qwen3_omni_dir):
    from omnistage.models.qwen3_omni.processor import Qwen3OmniInputProcessor
    from omnistage.models.qwen3_omni.thinker import thinker_sequence
    make = omni_seqs(Qwen3OmniInputProcessor, thinker_sequence)
    make.path = tiny_qwen3_omni_dir
    return make, run_stage(tiny_qwen3_omni_dir, "qwen3_omni", "thinker", 1, make,
                           record_router=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen3_omni_thinker_tp_matches_tp1(tiny_qwen3_omni_dir, qwen3_case, tp):
    make, ref = qwen3_case
    got = run_stage(tiny_qwen3_omni_dir, "qwen3_omni", "thinker", tp, make, record_router=True)
    assert_router_close(ref, got, first_divergence(ref, got))
    assert_shares(ref, got, tp)
    experts = [s for n, s in got["reports"][1].param_shapes.items()
               if n.endswith("experts.down_proj")]
    assert experts and all(s[2] * tp == 32 for s in experts)  # moe_intermediate_size 32


# ------------------------------------------------------------------------- shutdown
def tp_llm_yaml(tmp_path, devices: list[str]) -> str:
    import yaml
    data = load_pipeline("llm").model_dump(mode="json", exclude_defaults=True)
    data["stages"][0].update(tensor_parallel_size=2, devices=devices,
                             engine={"max_num_seqs": 4})
    path = tmp_path / "tp2.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.parametrize("background,devices", [
    (False, ["cpu", "cpu"]), (True, ["cpu", "cpu"]),
    pytest.param(False, ["cuda:0", "cuda:1"], marks=[pytest.mark.gpu, TWO_GPUS])],
    ids=["OmniLLM", "AsyncOmniLLM", "OmniLLM-nccl"])
def test_shutdown_stops_ranks_in_order(tiny_qwen2, tmp_path, background, devices):
    """OmniLLM.shutdown (and AsyncOmniLLM's, which the server calls) stops the worker rank:
    it leaves its loop, shuts its side of the group and goes back to the pool idle (it then
    builds the next engine's rank: it waits in no collective); rank 0's group is shut too."""
    import asyncio

    from omnistage import AsyncOmniLLM, OmniLLM
    from omnistage.engine.ar import tp_workers as tp_mod
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}, {"prompt_token_ids": [9, 8, 7]}]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def build():
        kw = {"device": devices[0], "pipeline": tp_llm_yaml(tmp_path, devices),
              "max_model_len": 256}
        return AsyncOmniLLM(str(tiny_qwen2), **kw) if background else \
            OmniLLM(str(tiny_qwen2), **kw)

    def generate(llm) -> list[list[int]]:
        if not background:
            return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

        async def one(i: int) -> list[int]:
            async for out in llm.generate(prompts[i], params, request_id=f"r{i}"):
                last = out
            return last.token_ids

        async def both() -> list[list[int]]:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(2))), 60)
        return asyncio.run(both())

    # an empty pool (earlier tests' idle ranks leave when told), so the second engine's rank
    # can only be the first engine's
    assert all(code == 0 for code in tp_mod.stop_idle_workers())
    runs, pids = [], []
    for _ in range(2):  # the second engine is built on the pool's (idle) rank
        llm = build()
        handle = llm.pipeline.engines["llm"].runner.tp_workers
        assert handle is not None and len(handle.workers) == 1
        rank_pid = handle.workers[0].proc.pid
        pids.append(rank_pid)
        assert rank_pid not in tp_mod.idle_workers()  # in a group while the engine lives
        group, store = weakref.ref(handle.tp.group), weakref.ref(handle.tp.store)
        runs.append(generate(llm))
        llm.shutdown()
        assert handle.closed and rank_pid in tp_mod.idle_workers()
        with pytest.raises(RuntimeError, match="group is shut"):  # rank 0's side is shut
            handle.tp.all_reduce(torch.ones(1))
        # and destroyed, with its threads, while the engine's process goes on (not left to
        # the interpreter's finalisation)
        gc.collect()
        assert group() is None and store() is None
        llm.shutdown()  # again: nothing left to stop
    assert runs[0] == runs[1] and all(len(t) == MAX_TOKENS for t in runs[0])
    assert pids[0] == pids[1]  # the idle rank took the second engine's job
    # the idle rank leaves its loop when told (no collective holds it; else: terminated, -15)
    assert tp_mod.idle_workers() == [rank_pid] and tp_mod.stop_idle_workers() == [0]
    assert tp_mod.idle_workers() == []


def test_script_without_main_guard_fails_fast(tiny_qwen2, tmp_path):
    """The worker ranks are spawned processes that import the main script; one that builds a
    TP stage unguarded fails in each rank's start-up. Rank 0 raises naming the guard, at once,
    instead of waiting DEFAULT_TIMEOUT_S (300 s) in the group's rendezvous."""
    import subprocess
    import sys
    import time
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from omnistage import OmniLLM\n"
        f"OmniLLM({str(tiny_qwen2)!r}, device='cpu', max_model_len=256,\n"
        f"        pipeline={tp_llm_yaml(tmp_path, ['cpu', 'cpu'])!r})\n"
        "print('built')\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert time.monotonic() - t0 < 60
    assert done.returncode != 0 and "built" not in done.stdout
    assert "ended (exit code" in done.stderr and 'if __name__ == "__main__":' in done.stderr


# ------------------------------------------------------------------------- bad sizes
def test_bad_tensor_parallel_sizes(tiny_qwen2):
    from omnistage.models.qwen2.model import Qwen2ForCausalLM
    config = load_config(tiny_qwen2)  # 4 heads, 2 KV heads, intermediate 128
    with tensor_parallel(TensorParallel(0, 3)), torch.device("meta"):
        with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide "
                                             "num_attention_heads"):
            Qwen2ForCausalLM(config)
    with tensor_parallel(TensorParallel(0, 2)), torch.device("meta"):
        with pytest.raises(ValueError, match="tensor_parallel_size: 2 does not divide "
                                             "intermediate_size"):
            Qwen2ForCausalLM(dict(config, intermediate_size=129))
    with pytest.raises(ValueError, match="tensor_parallel_size: 8 does not divide "
                                         "num_attention_heads"):
        head_layout(4, 2, TensorParallel(0, 8))
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide "
                                         "num_key_value_heads"):
        head_layout(12, 3, TensorParallel(0, 4))
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide "
                                         "moe_intermediate_size"):
        split(32, TensorParallel(0, 3), "moe_intermediate_size")
    # only models whose forward embeds through the vocab-parallel table shard
    from omnistage.models.qwen2_5_omni.talker import Qwen2_5OmniTalkerForCausalLM
    from omnistage.models.qwen2_5_omni.thinker import Qwen2_5OmniThinkerForCausalLM
    from omnistage.models.qwen3_omni.thinker import Qwen3OmniThinkerForCausalLM
    assert Qwen2ForCausalLM.supports_tensor_parallel()
    assert Qwen2_5OmniThinkerForCausalLM.supports_tensor_parallel()
    assert Qwen3OmniThinkerForCausalLM.supports_tensor_parallel()
    assert Qwen2_5OmniTalkerForCausalLM.supports_tensor_parallel()  # (its own forward, collective)
    # more ranks than GPUs, fewer devices than ranks, mixed devices
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_devices(2, [torch.device("cuda", torch.cuda.device_count()),
                          torch.device("cuda", torch.cuda.device_count() + 1)])
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 ranks but 1 devices"):
        check_devices(2, [CPU])
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_devices(2, [CPU, torch.device("cuda", 0)])
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_devices(0, [])


# ------------------------------------------------------------------------- sharded loading
def test_sharded_loading_reads_each_ranks_slice(tmp_path):
    """Each rank's parameters are its slices of the whole tensors, read lazily from the
    safetensors file: the vocab padded (10 rows over 4 ranks), the experts' fused gate_up
    (its gate block, then its up block) and per-expert matrices, a row-parallel weight."""
    from safetensors.torch import save_file

    from omnistage.checkpoint import iter_tensors, load_parameters
    from omnistage.layers.moe import MoEExperts
    from omnistage.layers.parallel import VocabParallelEmbedding, row_linear
    from omnistage.layers.moe_decoder import load_named_tensors

    g = torch.Generator().manual_seed(0)
    E, F, D, V = 3, 8, 4, 10
    whole = {"emb.weight": torch.randn(V, D, generator=g),
             "row.weight": torch.randn(D, F, generator=g),
             "fused.gate_up_proj": torch.randn(E, 2 * F, D, generator=g),
             "fused.down_proj": torch.randn(E, D, F, generator=g)}
    per_expert = {f"experts.{e}.{p}.weight": torch.randn(*(F, D) if p != "down_proj" else (D, F),
                                                       generator=g)
                  for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    save_file({**whole, **per_expert}, str(tmp_path / "model.safetensors"))
    for size in (2, 4):
        for rank in range(size):
            with tensor_parallel(TensorParallel(rank, size)):
                module = torch.nn.Module()
                module.emb = VocabParallelEmbedding(V, D, TensorParallel(rank, size))
                module.row = row_linear(F, D, rank * F // size, F // size, bias=False)
                module.fused = MoEExperts(E, D, F)
                module.experts = MoEExperts(E, D, F)
                tensors = list(iter_tensors(tmp_path))  # LazyTensors (in the group)
                assert all(not isinstance(t, torch.Tensor) for _, t in tensors)
                load_named_tensors(module, iter_tensors(tmp_path))
            per, f = -(-V // size), F // size
            rows = whole["emb.weight"][rank * per:(rank + 1) * per]
            want = torch.cat([rows, torch.zeros(per - rows.shape[0], D)])
            assert torch.equal(module.emb.weight, want)
            assert (module.emb.full_table is not None) == (rank == 0)
            assert torch.equal(module.row.weight, whole["row.weight"][:, rank * f:(rank + 1) * f])
            block = slice(rank * f, (rank + 1) * f)
            gu = whole["fused.gate_up_proj"]
            assert torch.equal(module.fused.gate_up_proj,
                               torch.cat([gu[:, block], gu[:, F:][:, block]], dim=1))
            assert torch.equal(module.fused.down_proj, whole["fused.down_proj"][:, :, block])
            for e in range(E):
                gate, up = per_expert[f"experts.{e}.gate_proj.weight"], \
                    per_expert[f"experts.{e}.up_proj.weight"]
                assert torch.equal(module.experts.gate_up_proj[e],
                                   torch.cat([gate[block], up[block]]))
                assert torch.equal(module.experts.down_proj[e],
                                   per_expert[f"experts.{e}.down_proj.weight"][:, block])
            with pytest.raises(ValueError, match="expected \\[10, 4\\]"):
                load_parameters(module.emb, [("weight", torch.zeros(V + 1, D))])
