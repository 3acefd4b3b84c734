"""Qwen3-Omni code2wav (omnistage/models/qwen3_omni/code2wav.py, code2wav_stage.py) against
transformers' Qwen3OmniMoeCode2Wav on the same random weights: the real depth (8 layers),
sliding window 72 and up-sampling rates, small widths; fp32 on the CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeCode2WavConfig)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnistage.config.schema import PipelineConfig, StageConfig
from omnistage.engine.gen import GenEngineConfig
from omnistage.models.qwen3_omni.code2wav import Qwen3OmniCode2Wav, Qwen3OmniCode2WavStreamState
from omnistage.models.qwen3_omni.code2wav_stage import (Qwen3OmniCode2WavOptions,
                                                        code2wav_worker, pop_code2wav_options)
from omnistage.models.registry import STAGE_BUILDERS
from omnistage.runtime.build import StageContext

CPU = torch.device("cpu")
CODEBOOK = 32
# small widths; the real depth, window, rates and ratios (num_key_value_heads < heads: GQA)
TINY = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
            decoder_dim=32, codebook_size=CODEBOOK, num_hidden_layers=8, sliding_window=72,
            upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2])


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny ops: one intra-op thread (two threads' barriers stall when other jobs share the
    two cores: 10x slower), restored after this file."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reinit(model: torch.nn.Module) -> None:
    """transformers' init leaves layer scales at 0.01 and ConvNeXt gamma at 1e-6 (attention and
    MLPs barely reach the output): torch's default init, scales 0.5, random Snake parameters."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.ConvTranspose1d,
                              torch.nn.Embedding, torch.nn.LayerNorm)):
                m.reset_parameters()
        for name, p in model.named_parameters():
            if name.endswith(("layer_scale.scale", "gamma")):
                p.fill_(0.5)
            elif name.endswith(("alpha", "beta")):
                p.normal_(0.0, 0.3)
            elif name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def models() -> tuple[Qwen3OmniMoeCode2Wav, Qwen3OmniCode2Wav]:
    torch.manual_seed(0)
    cfg = Qwen3OmniMoeCode2WavConfig(**TINY)
    ref = Qwen3OmniMoeCode2Wav(cfg).eval()
    _reinit(ref)
    ours = Qwen3OmniCode2Wav(cfg.to_dict()).eval()
    ours.load_weights(ref.state_dict().items())
    return ref, ours


def _codes(frames: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CODEBOOK, (batch, 16, frames), generator=g)


def _check_audible(wav: torch.Tensor) -> None:
    rms = wav.pow(2).mean().sqrt().item()
    assert rms > 1e-2, f"near-silent waveform (rms {rms:.2e}): the comparison would be vacuous"
    assert wav.std().item() > 1e-3, "constant waveform"
    assert (wav.abs() >= 1).float().mean().item() < 0.5, "mostly clipped at +-1"


@pytest.mark.parametrize("frames", [40, 150])
def test_whole_utterance_equals_transformers(models, frames):
    ref, ours = models
    codes = _codes(frames, batch=2, seed=frames)
    with torch.no_grad():
        expected = ref(codes)
        got = ours(codes)
    _check_audible(expected)
    assert got.shape == expected.shape == (2, 1, frames * 1920 - 555)
    assert ours.cfg.num_samples(frames) == frames * 1920 - 555
    assert (got - expected).abs().max().item() <= 1e-4
    assert not torch.equal(got[0], got[1])  # rows are decoded apart


def test_chunked_decode_equals_transformers(models):
    ref, ours = models
    codes = _codes(70, seed=1)
    with torch.no_grad():
        expected = ref.chunked_decode(codes, chunk_size=30, left_context_size=5)
        got = ours.chunked_decode(codes, chunk_size=30, left_context_size=5)
        exact = ours(codes)
    _check_audible(expected)
    assert got.shape == expected.shape == (1, 1, 70 * 1920 - 3 * 555)  # a tail lost per chunk
    assert (got - expected).abs().max().item() <= 1e-4
    assert exact.shape[-1] == 70 * 1920 - 555


@pytest.fixture(scope="module")
def long_utterance(models) -> tuple[torch.Tensor, torch.Tensor]:
    """200 frames (beyond the window), two rows, and their whole-utterance decode."""
    _, ours = models
    codes = _codes(200, batch=2, seed=2)
    with torch.no_grad():
        whole = ours(codes, chunk_frames=None)
    _check_audible(whole)
    return codes, whole


@pytest.mark.parametrize("first", [1, 2, 4])
@pytest.mark.parametrize("later", [7, 25, 50])
def test_streaming_equals_whole_utterance(models, long_utterance, first, later):
    _, ours = models
    codes, whole = long_utterance
    state = ours.new_stream_state(2)
    pieces, start = [], 0
    with torch.no_grad():
        while start < codes.shape[-1]:
            n = first if start == 0 else later
            pieces.append(ours.decode_chunk(codes[..., start:start + n], state))
            start += n
    assert pieces[0].shape[-1] == min(first, 200) * 1920 - 555
    streamed = torch.cat(pieces, dim=-1)
    assert streamed.shape == whole.shape
    assert (streamed - whole).abs().max().item() <= 1e-4
    assert state.frames.tolist() == [200, 200]


def test_stream_beyond_the_attention_reach(models):
    """600 frames (> 8 layers x 72): the state carries everything the whole decode sees."""
    ref, ours = models
    codes = _codes(600, seed=3)
    with torch.no_grad():
        expected = ref(codes)
        state = ours.new_stream_state(1)
        streamed = torch.cat([ours.decode_chunk(codes[..., s:s + 100], state)
                              for s in range(0, 600, 100)], dim=-1)
    _check_audible(expected)
    assert streamed.shape == expected.shape
    assert (streamed - expected).abs().max().item() <= 1e-4


def test_states_stack_and_split(models):
    _, ours = models
    codes = _codes(30, batch=2, seed=4)
    with torch.no_grad():
        solo = [ours.new_stream_state(1), ours.new_stream_state(1)]
        for i in range(2):
            ours.decode_chunk(codes[i:i + 1, :, :10], solo[i])
        batched = Qwen3OmniCode2WavStreamState.stack(solo)
        out = ours.decode_chunk(codes[..., 10:], batched)
        whole = ours(codes)
    assert (out - whole[..., 10 * 1920 - 555:]).abs().max().item() <= 1e-4
    assert [s.frames.item() for s in batched.split()] == [30, 30]
    with pytest.raises(ValueError, match="started and fresh"):
        Qwen3OmniCode2WavStreamState.stack([solo[0], ours.new_stream_state(1)])


def _feed(worker, pieces: dict[str, list[torch.Tensor]], start: dict[str, int],
          finish_late: set[str]) -> dict[str, list]:
    """Drive the worker as the talker adapter would: a request is submitted at its start round
    and gets one piece of codes per round, each round ends with a step; requests in
    finish_late get their end as a separate empty input."""
    events: dict[str, list] = {rid: [] for rid in pieces}
    rounds = max(start[rid] + len(p) for rid, p in pieces.items())
    for t in range(rounds + 1):
        for rid, p in pieces.items():
            k = t - start[rid]
            if k == 0:
                worker.submit(rid, None)
            if 0 <= k < len(p):
                worker.add_input(rid, p[k], k == len(p) - 1 and rid not in finish_late)
            elif k == len(p) and rid in finish_late:
                worker.add_input(rid, torch.zeros(0, 16, dtype=torch.long), True)
        for ev in worker.step():
            events[ev.request_id].append(ev)
    while worker.has_work():
        for ev in worker.step():
            events[ev.request_id].append(ev)
    return events


def test_worker_batches_requests_of_different_lengths(models):
    _, ours = models
    a, b = _codes(61, seed=5)[0].T, _codes(23, seed=6)[0].T  # [frames, 16]
    worker = code2wav_worker("code2wav", ours, CPU, GenEngineConfig(cuda_graphs="off"),
                             Qwen3OmniCode2WavOptions(first_chunk_frames=2, chunk_frames=7))
    # b joins while a is at later chunks (a first and a later chunk in one step); b: 23 =
    # 2 + 3 x 7 frames, its end arriving after its last chunk
    events = _feed(worker, {"a": list(a.split(5)), "b": list(b.split(3))},
                   start={"a": 0, "b": 3}, finish_late={"b"})
    assert not worker.requests
    assert worker.stats()["max_batch_size"] == 2
    assert worker.model.stats()["decode_calls"] > worker.stats()["steps"]  # first + later mixed
    for rid, codes in (("a", a), ("b", b)):
        evs = events[rid]
        assert [e.finished for e in evs] == [False] * (len(evs) - 1) + [True]
        assert all(e.error is None for e in evs)
        audio = np.concatenate([e.audio for e in evs if e.audio is not None])
        assert audio.dtype == np.float32 and audio.ndim == 1
        with torch.no_grad():
            solo = ours(codes.T[None])[0, 0].numpy()
        _check_audible(torch.from_numpy(solo))
        assert audio.shape == solo.shape
        assert np.abs(audio - solo).max() <= 1e-4
    assert events["b"][-1].audio is None  # its end came with no frames left to decode


def test_input_from_another_thread_while_chunks_are_taken(models):
    """The talker's frames arrive on the runtime's thread while the engine's launcher thread
    takes chunks (a race lost frames on an H200 at 64 requests): nothing is lost or reordered."""
    import threading

    _, ours = models
    frames = _codes(90, seed=7)[0].T
    worker = code2wav_worker("code2wav", ours, CPU,
                             GenEngineConfig(cuda_graphs="off", launch_thread=True),
                             Qwen3OmniCode2WavOptions(first_chunk_frames=1, chunk_frames=2))
    worker.submit("a", None)

    def feed():
        for k, piece in enumerate(frames.split(1)):
            worker.add_input("a", piece, k == frames.shape[0] - 1)

    feeder = threading.Thread(target=feed)
    feeder.start()
    events = []
    while feeder.is_alive() or worker.has_work():
        events += worker.step()
    feeder.join()
    assert all(e.error is None for e in events) and events[-1].finished
    audio = np.concatenate([e.audio for e in events if e.audio is not None])
    with torch.no_grad():
        solo = ours(frames.T[None])[0, 0].numpy()
    assert audio.shape == solo.shape and np.abs(audio - solo).max() <= 1e-4


def test_add_input_validation(models):
    _, ours = models
    worker = code2wav_worker("code2wav", ours, CPU, GenEngineConfig(cuda_graphs="off"))
    worker.submit("r", None)
    with pytest.raises(ValueError, match="codes"):
        worker.add_input("r", torch.zeros(3, 15, dtype=torch.long), False)
    with pytest.raises(ValueError, match="integer"):
        worker.add_input("r", torch.zeros(3, 16), False)
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        worker.add_input("r", torch.full((3, 16), CODEBOOK), False)
    worker.add_input("r", torch.zeros(3, 16, dtype=torch.long), True)
    with pytest.raises(ValueError, match="after the last"):
        worker.add_input("r", torch.zeros(1, 16, dtype=torch.long), True)


def test_load_weights_checks_names_and_shapes(models):
    ref, _ = models
    tensors = dict(ref.state_dict())
    fresh = Qwen3OmniCode2Wav(Qwen3OmniMoeCode2WavConfig(**TINY).to_dict())
    missing = {k: v for k, v in tensors.items() if not k.endswith("decoder.6.conv.bias")}
    with pytest.raises(ValueError, match="missing.*decoder.6.conv.bias"):
        fresh.load_weights(missing.items())
    with pytest.raises(ValueError, match="shape"):
        fresh.load_weights({**tensors, "code_embedding.weight": torch.zeros(3, 32)}.items())
    with pytest.raises(ValueError, match="no such parameter"):
        fresh.load_weights({**tensors, "decoder.9.weight": torch.zeros(1)}.items())


def test_options_and_stage_builder(models, tmp_path):
    ref, ours = models
    with pytest.raises(ValueError, match="code2wav_chunk_frames"):
        pop_code2wav_options({"code2wav_chunk_frames": 0})
    with pytest.raises(ValueError, match="code2wav_max_batch"):
        pop_code2wav_options({"code2wav_max_batch": 0})
    opts = {"code2wav_first_chunk_frames": 1, "code2wav_cuda_graphs": "off", "max_num_seqs": 4}
    engine, options = pop_code2wav_options(opts)
    assert opts == {"max_num_seqs": 4}
    assert options == Qwen3OmniCode2WavOptions(first_chunk_frames=1, chunk_frames=25)
    assert engine.cuda_graphs == "off"
    # a checkpoint in the released layout: `code2wav.` tensors, code2wav_config in config.json
    config = {"architectures": ["Qwen3OmniMoeForConditionalGeneration"],
              "code2wav_config": Qwen3OmniMoeCode2WavConfig(**TINY).to_dict()}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({f"code2wav.{k}": v.contiguous() for k, v in ref.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    stage = StageConfig(name="code2wav", kind="gen", model="Qwen3OmniMoeCode2Wav",
                        output="audio")
    assert STAGE_BUILDERS["Qwen3OmniMoeCode2Wav"].sample_rate == 24000
    ctx = StageContext(tmp_path, config, PipelineConfig(name="t", stages=[stage]), stage, CPU,
                       torch.float32, {"code2wav": (engine, options)})
    worker = STAGE_BUILDERS["Qwen3OmniMoeCode2Wav"].build(ctx)
    codes = _codes(5, seed=7)
    worker.submit("r", None)
    worker.add_input("r", codes[0].T, True)
    audio = []
    while worker.has_work():
        audio += [e.audio for e in worker.step() if e.audio is not None]
    assert [len(x) for x in audio] == [1920 - 555, 4 * 1920]  # first chunk: 1 frame
    with torch.no_grad():
        expected = ours(codes)[0, 0].numpy()
    assert np.abs(np.concatenate(audio) - expected).max() <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_worker_on_cuda(models, dtype):
    """Two requests batched through the worker with the CUDA defaults (launcher thread, steps
    in parts), against the fp32 CPU decode (TF32 convs allowed: a loose bound in fp32 too)."""
    _, ours = models
    cuda = torch.device("cuda")
    gpu_model = Qwen3OmniCode2Wav(ours.cfg).to(cuda, dtype).eval()
    gpu_model.load_weights(ours.state_dict().items())
    worker = code2wav_worker("code2wav", gpu_model, cuda, GenEngineConfig(),
                             Qwen3OmniCode2WavOptions(first_chunk_frames=2, chunk_frames=7))
    a, b = _codes(61, seed=5)[0].T, _codes(23, seed=6)[0].T
    events = _feed(worker, {"a": list(a.split(5)), "b": list(b.split(3))},
                   start={"a": 0, "b": 3}, finish_late=set())
    bound = 1e-2 if dtype == torch.float32 else 5e-2
    for rid, codes in (("a", a), ("b", b)):
        audio = np.concatenate([e.audio for e in events[rid] if e.audio is not None])
        with torch.no_grad():
            solo = ours(codes.T[None])[0, 0].numpy()
        assert audio.shape == solo.shape and np.isfinite(audio).all()
        rel = np.sqrt(np.mean((audio - solo) ** 2) / np.mean(solo ** 2))
        assert rel < bound, f"{rid}: relative RMS error {rel:.2e}"
