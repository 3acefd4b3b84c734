"""The voice-chat page at / in Debian's Chromium (driven by Playwright's Python API; its own
browser download is not reachable), its microphone fed by Chromium's fake capture device from an
espeak-ng WAV: the page connects, sends audio, gets an answer's transcript on screen and its
audio scheduled for playback, and the looped speech interrupts a long answer (truncated).

Without a `chromium` binary the test skips, except under CI=true, where it fails."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile

from tests.entrypoints.realtime_utils import serve_tiny_omni, silence, speak

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "realtime.png"


def _browser_or_skip() -> str:
    if CHROMIUM is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed (apt-get install -y chromium); CI must run "
                        "the browser test")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    return CHROMIUM


@pytest.fixture(scope="module")
def srv(tiny_omni_dir):
    yield from serve_tiny_omni(tiny_omni_dir)


def test_page_talks_and_is_interrupted(srv, tmp_path):
    chromium = _browser_or_skip()
    from playwright.sync_api import sync_playwright

    # what the fake microphone says, looped: a question, then a pause long enough for VAD
    wav = tmp_path / "mic.wav"
    pcm = np.concatenate([silence(0.5), speak("Hello, can you tell me a story?"), silence(1.5)])
    soundfile.write(wav, pcm, 24000, subtype="PCM_16")
    # long answers, so that the looped question comes back while one is still speaking
    defaults = srv.llm.pipeline.default_params
    thinker, talker = srv.llm.stage_names[:2]
    saved = dict(defaults)
    defaults[thinker] = dataclasses.replace(defaults[thinker], min_tokens=200, max_tokens=200)
    defaults[talker] = dataclasses.replace(defaults[talker], min_tokens=400, max_tokens=600)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=[
                "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                f"--use-file-for-fake-audio-capture={wav}",
                "--autoplay-policy=no-user-gesture-required", "--no-sandbox"])
            page = browser.new_page(viewport={"width": 1100, "height": 720})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(srv.url + "/?mode=free")
            page.wait_for_function("document.querySelector('#voice').options.length > 0")
            page.click("#start")
            page.wait_for_function("window.omnistage.connected", timeout=20000)
            page.wait_for_function("window.omnistage.sentChunks > 10", timeout=20000)
            # an answer: transcript on screen and audio scheduled for playback
            page.wait_for_function("window.omnistage.scheduled > 0 && "
                                   "window.omnistage.transcript.length > 0", timeout=90000)
            # the question comes round again while the answer speaks: it is interrupted
            page.wait_for_function("window.omnistage.truncated > 0", timeout=90000)
            page.wait_for_function("window.omnistage.done.includes('cancelled')",
                                   timeout=30000)
            stats = page.evaluate("window.omnistage")
            bubble = page.inner_text(".msg.assistant")
            users = page.locator(".msg.user audio").count()
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT))
            page.click("#stop")
            browser.close()
    finally:
        defaults.update(saved)
    assert not errors, errors
    assert stats["sentBytes"] > 24000  # over a second of microphone audio went out
    assert stats["audioBytes"] > 0 and stats["audioDeltas"] > 0
    assert bubble.strip() and stats["transcript"].startswith(bubble.strip()[:5])
    assert users >= 1  # the user's turn as an audio bubble
    assert not stats["errors"], stats["errors"]
    srv.wait_idle()
