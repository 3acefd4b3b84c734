"""The `omnistage` command: demo (subprocess, from an empty cache), generate and serve's
argument checks (in process)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import resources

import numpy as np
import soundfile

from omnistage.entrypoints.cli import main


def test_demo_writes_reply_wav(tmp_path):
    out = tmp_path / "reply.wav"
    # the README's demo install has no triton (the CPU torch wheel does not pull it): a package
    # first on the path that fails to import stands in for it
    (tmp_path / "no_triton" / "triton").mkdir(parents=True)
    (tmp_path / "no_triton" / "triton" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'triton'\", name='triton')\n")
    path = os.pathsep.join(p for p in (str(tmp_path / "no_triton"), os.environ.get("PYTHONPATH"))
                           if p)
    env = {**os.environ, "OMNISTAGE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": path}
    p = subprocess.run([sys.executable, "-m", "omnistage.entrypoints.cli", "demo", "--output",
                        str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    wave, sr = soundfile.read(out, dtype="float32")
    assert sr == 24000 and len(wave) > 0 and np.abs(wave).max() > 0.01
    assert "random weights" in p.stdout and "Qwen/Qwen2.5-Omni-7B" in p.stdout
    for stage in ("thinker", "talker", "code2wav"):
        assert f"  {stage}" in p.stdout  # the per-stage timing table
    assert (tmp_path / "cache" / "tiny-qwen2_5-omni" / "config.json").is_file()


def test_demo_qwen3_omni_writes_reply_wav(tmp_path):
    out = tmp_path / "reply.wav"
    env = {**os.environ, "OMNISTAGE_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-m", "omnistage.entrypoints.cli", "demo", "--model",
                        "tiny-qwen3-omni", "--output", str(out), "--max-audio-seconds", "3"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    wave, sr = soundfile.read(out, dtype="float32")
    # at most 3 s: 37 frames, the last one cut (max_tokens) -> 36 x 1920 - 555 samples
    assert sr == 24000 and 0 < len(wave) <= 36 * 1920 - 555 and np.abs(wave).max() > 0.01
    assert "Qwen3-Omni" in p.stdout and "Qwen/Qwen3-Omni-30B-A3B-Instruct" in p.stdout
    assert (tmp_path / "cache" / "tiny-qwen3-omni" / "config.json").is_file()


def test_demo_asset_is_small_16k_mono():
    asset = resources.files("omnistage") / "assets" / "question.wav"
    info = soundfile.info(str(asset))
    assert info.samplerate == 16000 and info.channels == 1 and info.duration > 1.0
    assert len(asset.read_bytes()) < 100_000


def test_generate_text_audio_in_audio_out(tiny_omni_dir, tmp_path, capsys):
    asset = resources.files("omnistage") / "assets" / "question.wav"
    wav = tmp_path / "out.wav"
    rc = main(["generate", str(tiny_omni_dir), "--device", "cpu", "--audio", str(asset),
               "--prompt", "Answer briefly.", "--max-tokens", "6", "--seed", "0",
               "--output-audio", str(wav), "--voice", "Ethan", "--max-model-len", "1024"])
    assert rc == 0
    assert capsys.readouterr().out.strip()
    assert soundfile.info(str(wav)).frames > 0
    # the original flags still work: --chat, sampling flags, engine flags
    rc = main(["generate", str(tiny_omni_dir), "--device", "cpu", "--prompt", "Hi", "--chat",
               "--max-tokens", "4", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5",
               "--seed", "1", "--max-num-seqs", "4"])
    assert rc == 0 and capsys.readouterr().out.strip()


def test_generate_and_serve_reject_bad_arguments(tiny_omni_dir, capsys):
    assert main(["generate", str(tiny_omni_dir)]) == 2  # no prompt and no media
    assert main(["generate", str(tiny_omni_dir), "--audio", "/nonexistent.wav"]) == 2
    assert main(["serve", str(tiny_omni_dir), "--max-queue", "0"]) == 2
    assert "max_queue" in capsys.readouterr().err
    for interval in ("0", "nan", "1e9"):  # (checked before any model loading)
        assert main(["serve", str(tiny_omni_dir), "--switch-interval-ms", interval]) == 2
        assert "switch_interval_ms: 0.05 to 100.0" in capsys.readouterr().err
