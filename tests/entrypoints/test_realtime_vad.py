"""Server VAD: omnistage's Silero network equals silero-vad's own TorchScript model (its weights
copied in), and the turn detector finds an espeak-ng question inside silence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.entrypoints.openai.realtime.vad import CONTEXT, WINDOW, SileroVAD, TurnDetector
from omnistage.models.qwen2_5_omni.media import resample
from tests.entrypoints.realtime_utils import silence, speak


def test_network_equals_silero_reference():
    silero_vad = pytest.importorskip("silero_vad")
    threads = torch.get_num_threads()
    try:
        ref = silero_vad.load_silero_vad()  # (importing silero_vad sets torch's threads)
    finally:
        torch.set_num_threads(threads)
    inner = ref._model
    p, b = dict(inner.named_parameters()), dict(inner.named_buffers())
    state = {"stft_conv.weight": b["stft.forward_basis_buffer"],
             "final_conv.weight": p["decoder.decoder.2.weight"],
             "final_conv.bias": p["decoder.decoder.2.bias"]}
    for i in range(4):
        for k in ("weight", "bias"):
            state[f"conv{i + 1}.{k}"] = p[f"encoder.{i}.reparam_conv.{k}"]
    for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        state[f"lstm_cell.{k}"] = p[f"decoder.rnn.{k}"]
    ours = SileroVAD()
    ours.load_state_dict({k: v.detach() for k, v in state.items()})
    x = resample(speak("Hello, what is the weather like today?").astype(np.float32) / 32768,
                 24000, 16000).astype(np.float32)
    h, ctx = torch.zeros(2, 1, 128), np.zeros(CONTEXT, np.float32)
    ours_p, ref_p = [], []
    with torch.no_grad():
        for i in range(0, len(x) - WINDOW, WINDOW):
            w = x[i:i + WINDOW]
            prob, h = ours(torch.from_numpy(np.concatenate([ctx, w]))[None], h)
            ctx = w[-CONTEXT:]
            ours_p.append(float(prob[0]))
            ref_p.append(float(ref(torch.from_numpy(w.copy()), 16000)))
    np.testing.assert_allclose(ours_p, ref_p, atol=1e-5)
    assert max(ref_p) > 0.9 and min(ref_p) < 0.1  # (speech and pauses both seen)


def test_turn_detector_finds_the_question():
    speech = speak("What is the weather like today?")
    pcm = np.concatenate([silence(1.0), speech, silence(1.0)])
    det = TurnDetector(threshold=0.5, silence_duration_ms=500, prefix_padding_ms=300)
    events = [e for chunk in np.array_split(pcm, len(pcm) // 480) for e in det.feed(chunk)]
    assert [e.kind for e in events] == ["start", "stop"]
    end_of_speech = (24000 + len(speech)) * 1000 // 24000
    assert 1000 - 300 - 200 <= events[0].ms <= 1000 - 300 + 300
    assert end_of_speech <= events[1].ms <= end_of_speech + 500 + 300
