"""Server VAD: Silero VAD (the PyPI `silero-vad` package's 16 kHz network, loaded from the
safetensors file it ships; its TorchScript file is not loaded, and the package's module is not
imported: importing it sets torch's thread count for the whole process) and a streaming turn
detector over pcm16 24 kHz input with OpenAI's server_vad settings."""

from __future__ import annotations

import importlib.resources
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

VAD_RATE = 16000
WINDOW = 512  # samples at 16 kHz per probability (32 ms), the network's fixed frame
CONTEXT = 64  # samples of the previous window prepended to each (as silero's own wrapper does)
_WEIGHTS = "silero_vad_16k.safetensors"


class SileroVAD(nn.Module):
    """Silero VAD v5/v6 at 16 kHz: a fixed STFT as a conv, 4 conv layers, an LSTM cell, a 1x1
    conv head. forward(x [B, CONTEXT + WINDOW], state [2, B, 128]) -> (prob [B], state)."""

    def __init__(self) -> None:
        super().__init__()
        self.stft_conv = nn.Conv1d(1, 258, kernel_size=256, stride=128, bias=False)
        self.conv1 = nn.Conv1d(129, 128, 3, padding=1)
        self.conv2 = nn.Conv1d(128, 64, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(64, 64, 3, stride=2, padding=1)
        self.conv4 = nn.Conv1d(64, 128, 3, padding=1)
        self.lstm_cell = nn.LSTMCell(128, 128)
        self.final_conv = nn.Conv1d(128, 1, 1)

    def forward(self, x: torch.Tensor, state: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x = nn.functional.pad(x, (0, 64), mode="reflect").unsqueeze(1)
        x = self.stft_conv(x)
        x = (x[:, :129] ** 2 + x[:, 129:] ** 2).sqrt()  # magnitude spectrum
        for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
            x = conv(x).relu()
        h, c = self.lstm_cell(x.squeeze(-1), (state[0], state[1]))
        prob = self.final_conv(h.unsqueeze(-1).relu()).sigmoid()
        return prob.squeeze(1).mean(dim=1), torch.stack([h, c])


_model: SileroVAD | None = None
_model_lock = threading.Lock()


def load_vad() -> SileroVAD:
    """The network, loaded once per process (shared read-only by every session)."""
    global _model
    with _model_lock:
        if _model is None:
            try:
                files = importlib.resources.files("silero_vad") / "data" / _WEIGHTS
            except ModuleNotFoundError as e:
                raise RuntimeError("server VAD needs the silero-vad package (pip install "
                                   "--no-deps silero-vad)") from e
            with importlib.resources.as_file(files) as path:
                weights = load_file(str(path))
            model = SileroVAD()
            model.load_state_dict(weights)
            _model = model.eval()
    return _model


class Resampler24To16:
    """Streaming 24 kHz -> 16 kHz (x2 up, windowed-sinc low-pass at 7.2 kHz, /3 down) with the
    filter's history kept between calls, so chunk boundaries leave no clicks."""

    TAPS = 96

    def __init__(self) -> None:
        n = np.arange(self.TAPS) - (self.TAPS - 1) / 2
        cutoff = 7200 / 48000  # of the 48 kHz intermediate rate
        h = 2 * cutoff * np.sinc(2 * cutoff * n) * np.kaiser(self.TAPS, 8.0)
        self.h = (h / h.sum() * 2).astype(np.float32)  # gain 2: zero stuffing halves the level
        self.history = np.zeros(self.TAPS - 1, np.float32)  # upsampled samples
        self.phase = 0  # index in the next upsampled block of the next output sample

    def __call__(self, x: np.ndarray) -> np.ndarray:
        up = np.zeros(2 * len(x), np.float32)
        up[::2] = x
        ext = np.concatenate([self.history, up])
        full = np.convolve(ext, self.h, mode="valid")  # one output per upsampled input sample
        out = full[self.phase::3]
        self.phase = (self.phase - len(up)) % 3
        self.history = ext[len(ext) - (self.TAPS - 1):]
        return out


@dataclass
class VadEvent:
    kind: str  # "start" or "stop"
    ms: int  # session audio time of the event (start includes prefix padding)


class TurnDetector:
    """OpenAI server_vad over a session's appended audio: speech starts when a window's
    probability reaches `threshold`; it stops after `silence_duration_ms` of windows below
    threshold - 0.15 (silero's own hysteresis). Times are in ms of audio appended so far.

    feed() runs the network here; detect_batch() runs many detectors' windows in one forward
    (the VAD worker thread) with the same results."""

    def __init__(self, threshold: float, silence_duration_ms: int, prefix_padding_ms: int
                 ) -> None:
        self.threshold, self.silence_ms = threshold, silence_duration_ms
        self.prefix_ms = prefix_padding_ms
        self.model = load_vad()
        self.resampler = Resampler24To16()
        self.pending = np.zeros(0, np.float32)  # 16 kHz samples not yet in a window
        self.context = np.zeros(CONTEXT, np.float32)
        self.state = torch.zeros(2, 1, 128)
        self.samples16 = 0  # windows consumed, in 16 kHz samples
        self.speaking = False
        self.silence_start: int | None = None  # ms where the current quiet run began

    def feed(self, pcm16: np.ndarray) -> list[VadEvent]:
        """Appended int16 samples at 24 kHz -> the start/stop events they complete."""
        return detect_batch([(self, pcm16)])[0]

    def _push(self, pcm16: np.ndarray) -> int:
        """Resample appended audio into the pending samples; the whole windows now pending."""
        self.pending = np.concatenate([self.pending,
                                       self.resampler(pcm16.astype(np.float32) / 32768.0)])
        return len(self.pending) // WINDOW

    def _take_window(self) -> np.ndarray:
        """The network's next input: the previous window's tail, then the next window."""
        window, self.pending = self.pending[:WINDOW], self.pending[WINDOW:]
        x = np.concatenate([self.context, window])
        self.context = window[-CONTEXT:]
        return x

    def _decide(self, p: float) -> VadEvent | None:
        """The turn state after a window of speech probability p; the event it completes."""
        start_ms = self.samples16 * 1000 // VAD_RATE
        self.samples16 += WINDOW
        end_ms = self.samples16 * 1000 // VAD_RATE
        if not self.speaking:
            if p >= self.threshold:
                self.speaking, self.silence_start = True, None
                return VadEvent("start", max(0, start_ms - self.prefix_ms))
        elif p < max(self.threshold - 0.15, 0.01):
            if self.silence_start is None:
                self.silence_start = start_ms
            if end_ms - self.silence_start >= self.silence_ms:
                self.speaking = False
                self.silence_start = None
                return VadEvent("stop", end_ms)
        else:
            self.silence_start = None
        return None


@torch.inference_mode()
def detect_batch(feeds: list[tuple[TurnDetector, np.ndarray]],
                 on_step: Callable[[int], None] | None = None) -> list[list[VadEvent]]:
    """feeds[i] = (detector, int16 24 kHz chunk appended to its session) -> the events of each
    chunk, equal to calling detector.feed(chunk) for each in order. A detector may appear more
    than once (its chunks in order); each step runs the next window of every detector that has
    one in one forward (the LSTM states batched), `on_step(batch)` after each."""
    models = {id(det.model): det.model for det, _ in feeds}
    if len(models) > 1:
        raise ValueError("detect_batch: the detectors do not share one VAD network")
    model = next(iter(models.values()), None)
    results: list[list[VadEvent]] = [[] for _ in feeds]
    # per detector: (windows completed by its chunks so far, the feed index) in order
    owners: dict[int, list[tuple[int, int]]] = {}
    detectors: dict[int, TurnDetector] = {}
    for i, (det, pcm16) in enumerate(feeds):
        detectors[id(det)] = det
        owners.setdefault(id(det), []).append((det._push(pcm16), i))
    done = dict.fromkeys(detectors, 0)  # windows run per detector
    while True:
        step = [d for key, d in detectors.items() if done[key] < owners[key][-1][0]]
        if not step:
            return results
        x = torch.from_numpy(np.stack([d._take_window() for d in step]))
        state = step[0].state if len(step) == 1 else torch.cat([d.state for d in step], dim=1)
        prob, state = model(x, state)
        if on_step is not None:
            on_step(len(step))
        # (one op each for all sessions: every torch call may wait for the GIL again)
        for det, p, det_state in zip(step, prob.tolist(), state.split(1, dim=1)):
            det.state = det_state
            key = id(det)
            window = done[key]
            done[key] = window + 1
            event = det._decide(p)
            if event is not None:  # to the first chunk whose push completed this window
                results[next(i for n, i in owners[key] if window < n)].append(event)
