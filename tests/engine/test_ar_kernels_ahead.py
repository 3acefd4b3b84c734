"""The AR engine's Triton kernels compiled ahead (engine/ar/kernels_ahead_ar.py): each kernel
family's compile_ahead compiles, in a process of its own, under the cache key that its real
launch computes (Triton compiles for an sm_90 target on the CPU: no GPU is needed to compile),
and the lister's variants for an engine config, a decoder's dims and a GPU's facts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnistage.engine.ar.cuda_graphs import DecodeGraphs
from omnistage.engine.ar.kernels_ahead_ar import (DecoderDims, GpuFacts, ar_kernel_jobs,
                                                  decode_input_misalignment)
from omnistage.engine.ar.scheduler import engine_config
from omnistage.engine.kernels_ahead import KernelsAhead, KernelJob, TensorSpec
from omnistage.sampling_params import SamplingParams

SM90 = ("cuda", 90, 32)
HOPPER = (9, 0)
SMS = 132  # what the launch code's _num_sms reports off CUDA (the real launches below)
BF16 = torch.bfloat16
H, KV, HD, PAGE = 4, 2, 32, 16  # tiny heads: each variant compiles in about a second
M, MB, B = 3, 16, 2  # decode graphs' largest size (misaligned inputs), table width, batch

Case = tuple[str, Callable[..., Any], tuple]


def _cases() -> tuple[list[Case], list[Case]]:
    """(compile_ahead calls, real launches) of one variant per kernel family, by name."""
    from omnistage.engine.ar import sampler_triton as st
    from omnistage.engine.ar import triton_attention as ta
    from omnistage.engine.ar import triton_gemv as tg
    from omnistage.engine.ar import triton_rope_kv as rk
    tables, lens = decode_input_misalignment(M)
    splits = ta.num_splits_for(B, KV, MB * PAGE, SMS)
    assert splits > 1 and (tables, lens) == (8, 12)  # the reduce kernel and unaligned pointers
    ahead = [
        # split K in 2, summed in the launch (fused), PDL
        ("gemv", tg.compile_ahead, ("gemv_residual", 64, 1024, 1, BF16, False, True, True,
                                    HOPPER, SMS)),
        ("prefill", ta.compile_ahead_prefill, (H, KV, HD, PAGE, BF16, 4)),
        ("decode", ta.compile_ahead_decode, (H, KV, HD, PAGE, BF16, splits, MB, tables, lens,
                                             True, HOPPER)),
        ("rope", rk.compile_ahead, (H, KV, HD, PAGE, BF16, True, HOPPER)),
        ("sampler", st.compile_ahead, (1000, 0, True)),
        ("sampler_warped", st.compile_ahead, (1000, 2, True)),
    ]
    # the warped draw launched first: its kernel shares a helper with the greedy one's finish
    # kernel, whose key must not depend on which of the two a process compiled first
    launched = [("gemv", _gemv, ()), ("prefill", _prefill, ()), ("decode", _decode, ()),
                ("rope", _rope, ()), ("sampler_warped", _sampler, (True,)),
                ("sampler", _sampler, (False,))]
    return ahead, launched


def _gemv() -> None:
    from omnistage.engine.ar import triton_gemv as tg
    x = torch.zeros(1, 64, dtype=BF16)
    tg.gemv_residual(torch.zeros(1, 1024, dtype=BF16), torch.zeros(64, 1024, dtype=BF16), x)


def _caches(blocks: int = 3) -> torch.Tensor:
    return torch.zeros(blocks, PAGE, KV, HD, dtype=BF16)


def _prefill() -> None:
    from omnistage.engine.ar import triton_attention as ta
    i32 = torch.int32
    ta.paged_prefill_attention(torch.zeros(16, H, HD, dtype=BF16), _caches(), _caches(),
                               torch.zeros(1, 4, dtype=i32), torch.tensor([0, 16], dtype=i32),
                               torch.tensor([16], dtype=i32), 16, HD ** -0.5)


def _decode() -> None:
    """As a decode graph of largest size M reads them: views of one int32 input buffer."""
    from omnistage.engine.ar import triton_attention as ta
    buf = torch.zeros(10 * M + M * MB, dtype=torch.int32)
    tables = buf[10 * M:].view(M, MB)[:B]
    ta.paged_decode_attention(torch.zeros(B, H, HD, dtype=BF16), _caches(), _caches(), tables,
                              buf[5 * M:5 * M + B], HD ** -0.5)


def _rope() -> None:
    from omnistage.engine.ar import triton_rope_kv as rk
    rope = torch.zeros(3, HD)
    rk.rope_write_kv(torch.zeros(3, (H + 2 * KV) * HD, dtype=BF16), rope, rope, _caches(),
                     _caches(), torch.zeros(3, dtype=torch.long), H, KV, HD)


def _sampler(top_k: bool) -> None:
    from omnistage.engine.ar import sampler_triton as st
    from omnistage.engine.ar.sampler import SamplerState, SamplingFlags
    state = SamplerState(4, 1000, torch.device("cpu"))
    rows = torch.tensor([0, 1])
    st.sample_rows(state, torch.zeros(2, 1000), rows, rows, None,
                   SamplingFlags(not top_k, top_k, False, False, True, False), True)


def _ahead_keys(cases: list[Case]) -> dict[str, list[str]]:
    return {name: fn(*args) for name, fn, args in cases}


def _launch_keys(cases: list[Case]) -> dict[str, list[str]]:
    """In the child: each real launch's cache keys, its kernels compiled as it launches them
    (then not launched: no GPU); PDL on, as on a Hopper GPU."""
    from omnistage.engine.ar import sampler_triton, triton_attention, triton_gemv, triton_rope_kv
    from omnistage.engine.ar.triton_pdl import pdl_flags
    for module in (triton_attention, triton_gemv, triton_rope_kv):
        module.pdl_kwargs = lambda device, enabled=True: pdl_flags(enabled, HOPPER)
    keys: list[str] = []
    kernels = [getattr(m, name) for m in (sampler_triton, triton_attention, triton_gemv,
                                          triton_rope_kv)
               for name in dir(m) if name.endswith("_kernel")]
    for kernel in kernels:
        kernel.run = _compile_only(kernel, keys)
    out = {}
    for name, fn, args in cases:
        keys.clear()
        fn(*args)
        out[name] = list(keys)
    return out


def _compile_only(kernel: Any, keys: list[str]) -> Callable[..., Any]:
    run = type(kernel).run

    def compile_launch(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        compiled = run(kernel, *args, grid=grid, warmup=True, **kwargs)
        keys.append(compiled.hash)
        return compiled
    return compile_launch


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[dict, dict, Path]:
    """Every family's variant compiled ahead in one process, then its real launches in
    another (two processes for all: each costs seconds of imports)."""
    pytest.importorskip("triton")
    cache = tmp_path_factory.mktemp("triton_cache")
    ahead, launched = _cases()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)  # (set by the kernels' CPU tests)
        mp.setenv("TRITON_CACHE_DIR", str(cache))
        jobs = KernelsAhead.start({"ar": (SM90, [KernelJob(_ahead_keys, (ahead,)),
                                                 KernelJob(_launch_keys, (launched,))])})
        ahead_keys, launch_keys = jobs.wait("ar")
    assert ahead_keys is not None and launch_keys is not None
    return ahead_keys, launch_keys, cache


# per family: the kernels its launch compiles
FAMILIES = {"gemv": ["_gemv_kernel"], "prefill": ["_prefill_kernel"],
            "decode": ["_decode_split_kernel", "_decode_reduce_kernel"],
            "rope": ["_rope_write_kv_kernel"], "sampler": ["_prep_kernel", "_finish_kernel"],
            "sampler_warped": ["_prep_kernel", "_warp_draw_kernel"]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_ahead_under_the_launchs_cache_keys(compiled, family) -> None:
    ahead_keys, launch_keys, _ = compiled
    assert ahead_keys[family] == launch_keys[family]
    assert len(ahead_keys[family]) == len(FAMILIES[family])


def test_the_launches_compiled_nothing_more(compiled) -> None:
    """On disk once each: the launches' process found every variant compiled ahead."""
    ahead_keys, _, cache = compiled
    names = sorted(p.stem for p in cache.glob("*/*.cubin"))
    assert names == sorted(name for family in FAMILIES for name in FAMILIES[family])
    assert len(names) == len({key for keys in ahead_keys.values() for key in keys})


def test_tensor_spec_reads_as_the_tensor() -> None:
    t = torch.zeros(5, 3, 4, dtype=torch.int32)[1:, :, :2]
    spec = TensorSpec(torch.int32, (4, 3, 2), t.stride(), offset=t.data_ptr() % 16)
    assert spec.stride() == t.stride() and spec.stride(0) == 12 and spec.data_ptr() == 0
    assert TensorSpec.empty((2, 0, 3), BF16).stride() == torch.empty(2, 0, 3).stride()


def test_decode_input_offsets_are_the_decode_graphs() -> None:
    for m in (1, 2, 3, 4, 64):
        g = DecodeGraphs(SimpleNamespace(), max_num_seqs=m, max_model_len=64, block_size=16,
                         dummy_block=0, uses_mrope=False, device=torch.device("cpu"),
                         dtype=BF16, eager=True)
        base = g.dev.data_ptr()
        assert base % 16 == 0
        assert decode_input_misalignment(m) == ((base + 4 * g._off["tables"]) % 16,
                                                (base + 4 * g._off["lens"]) % 16)


TINY = DecoderDims(hidden_size=64, num_heads=H, num_kv_heads=KV, head_dim=HD,
                   intermediate_size=128, vocab_size=1000, attention_bias=True)
FACTS = GpuFacts(HOPPER, SMS)


def test_lister_lists_each_distinct_variant_once(monkeypatch) -> None:
    pytest.importorskip("triton")
    from omnistage.engine.ar import sampler_triton as st
    from omnistage.engine.ar import triton_attention as ta
    from omnistage.engine.ar import triton_gemv as tg
    from omnistage.engine.ar import triton_rope_kv as rk
    # the tiny layer's four weights tuned: its 1-row decode steps take the GEMVs
    for n, k in ((256, 64), (64, 128)):
        monkeypatch.setitem(tg.CONFIGS, (n, k, 1), tg.GemvConfig(16, 64))
    engine = engine_config(32768, max_num_seqs=8)  # decode graphs of 1, 2, 4, 8 rows
    jobs = ar_kernel_jobs(TINY, BF16, engine, torch.device("cuda"),
                          [SamplingParams(temperature=0.9)], FACTS)
    mb = 32768 // PAGE
    # 2 waves of 132 SMs over B x 2 KV heads, at most 64 splits: B 1 and 2 -> 64, 4 -> 33,
    # 8 -> 17 (one variant each)
    decode = [(ta.compile_ahead_decode, (H, KV, HD, PAGE, BF16, s, mb, 0, 0, True, HOPPER))
              for s in (64, 33, 17)]
    assert [(j.compile, j.args) for j in jobs] == [
        # GEMVs first (the longest compiles); o_proj's and down_proj's: one variant
        (tg.compile_ahead, ("norm_gemv", 256, 64, 1, BF16, True, True, True, HOPPER, SMS)),
        (tg.compile_ahead, ("gemv_residual", 64, 128, 1, BF16, False, True, True, HOPPER,
                            SMS)),
        (tg.compile_ahead, ("norm_gemv_silu_mul", 256, 64, 1, BF16, False, True, True, HOPPER,
                            SMS)),
        (ta.compile_ahead_prefill, (H, KV, HD, PAGE, BF16, mb)), *decode,
        (rk.compile_ahead, (H, KV, HD, PAGE, BF16, True, HOPPER)),
        (st.compile_ahead, (1000, 0, True)),  # greedy (always warmed): prep + finish
        (st.compile_ahead, (1000, 1, False))]  # Gumbel draws: prep (its finish: greedy's)
    warped = ar_kernel_jobs(TINY, BF16, engine, torch.device("cuda"),
                            [SamplingParams(temperature=0.9, top_k=40)], FACTS)
    assert [j.args for j in warped[-2:]] == [(1000, 0, True), (1000, 2, True)]  # + warp_draw


def test_lister_follows_the_engine_switches() -> None:
    pytest.importorskip("triton")
    cuda = torch.device("cuda")

    def listed(**options: Any) -> list[str]:
        engine = engine_config(4096, max_model_len=1024, max_num_seqs=8, **options)
        return [f"{j.compile.__module__.rsplit('.', 1)[1]}.{j.compile.__name__}"
                for j in ar_kernel_jobs(TINY, BF16, engine, cuda, (), FACTS)]

    # untuned GEMV shapes (the layers take cuBLAS); 1024 keys: 8 splits at every batch size
    prefill = "triton_attention.compile_ahead_prefill"
    decode = "triton_attention.compile_ahead_decode"
    rope, sampler = "triton_rope_kv.compile_ahead", "sampler_triton.compile_ahead"
    assert listed() == [prefill, decode, rope, sampler]
    assert listed(cuda_graphs="off") == [prefill, rope, sampler]
    assert listed(fused_rope_kv=False) == [sampler]
    assert listed(fused_rope_kv=False, fast_sampler=False) == []
    engine = engine_config(4096)
    assert ar_kernel_jobs(TINY, BF16, engine, torch.device("cpu"), (), FACTS) == []
    tp = engine_config(4096, tensor_parallel_size=2, devices=["cuda:0", "cuda:1"])
    assert ar_kernel_jobs(TINY, BF16, tp, cuda, (), FACTS) == []


def _omni_ctx(tmp_path: Path, stage: str, device: str = "cuda", **options: Any) -> Any:
    """The 7B Qwen2.5-Omni's thinker or talker stage, as start_kernels_ahead gives it."""
    from omnistage.config.schema import load_pipeline
    from omnistage.runtime.build import StageContext
    text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                max_position_embeddings=32768,
                rope_scaling={"type": "default", "mrope_section": [16, 24, 24]})
    talker = dict(vocab_size=8448, hidden_size=896, intermediate_size=18944,
                  num_hidden_layers=24, num_attention_heads=12, num_key_value_heads=4,
                  head_dim=128, embedding_size=3584, max_position_embeddings=32768,
                  **{f"tts_codec_{n}_token_id": i for i, n in enumerate(
                      ("start", "end", "pad", "mask"))},
                  **{f"tts_text_{n}_token_id": 10 + i for i, n in enumerate(
                      ("start", "end", "pad"))})
    pipeline = load_pipeline("qwen2_5_omni")
    config = {"thinker_config": {"text_config": text}, "talker_config": talker}
    return StageContext(tmp_path, config, pipeline, pipeline.stage(stage), torch.device(device),
                        BF16, {"engine": {}, "quantization": None, **options})


def test_qwen2_5_omni_thinker_and_talker_list_their_variants(tmp_path, monkeypatch) -> None:
    pytest.importorskip("triton")
    from omnistage.engine.ar import kernels_ahead_ar
    from omnistage.models.qwen2_5_omni import pipeline
    from omnistage.models.registry import STAGE_BUILDERS
    monkeypatch.setattr(kernels_ahead_ar.GpuFacts, "of", classmethod(lambda cls, dev: FACTS))
    assert STAGE_BUILDERS["Qwen2_5OmniThinker"].kernels_ahead is pipeline.thinker_kernels_ahead
    assert STAGE_BUILDERS["Qwen2_5OmniTalker"].kernels_ahead is pipeline.talker_kernels_ahead
    thinker = pipeline.thinker_kernels_ahead(_omni_ctx(tmp_path, "thinker"))
    talker = pipeline.talker_kernels_ahead(_omni_ctx(tmp_path, "talker"))
    gemvs = {"thinker": [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)],
             "talker": [(2560, 896), (896, 1536), (37888, 896), (896, 18944)]}
    for name, jobs in (("thinker", thinker), ("talker", talker)):
        assert [j.args[1:3] for j in jobs[:4]] == gemvs[name]  # the tuned shapes
        assert [j.args[0] for j in jobs if j.compile.__name__ == "compile_ahead_decode"] == \
            [28 if name == "thinker" else 12] * 7  # 64, 33, 17, 9, 5, 3, 2 splits
    # greedy without a generation_config.json; the talker's YAML defaults warp (top-k/p)
    assert [j.args for j in thinker[-1:]] == [(152064, 0, True)]
    assert [j.args for j in talker[-2:]] == [(8448, 0, True), (8448, 2, True)]
    fp8 = pipeline.thinker_kernels_ahead(_omni_ctx(tmp_path, "thinker", quantization="fp8"))
    assert fp8 == thinker[4:]  # its FP8 GEMVs are left out
    assert pipeline.thinker_kernels_ahead(_omni_ctx(tmp_path, "thinker", "cpu")) == []
    assert pipeline.talker_kernels_ahead(_omni_ctx(tmp_path, "talker", "cpu")) == []
