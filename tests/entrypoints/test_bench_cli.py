"""`omnistage bench` (issue 26) against a running tiny-model server on CPU: valid JSON with the
counts the flags ask for and no errors (text and audio), what the server's /metrics counted
agrees, the API key is sent; bad flags and an unusable server give a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from omnistage.entrypoints.async_llm import AsyncOmniLLM
from omnistage.entrypoints.cli import main
from omnistage.entrypoints.openai.server import build_app
from omnistage.entrypoints.openai.serving import ServerConfig
from tests.entrypoints.server_utils import (MODEL_NAME, ThreadServer, metric, running_server,
                                            scrape)


@pytest.fixture(scope="module")
def server(tiny_omni_dir, tmp_path_factory) -> Iterator:
    log = tmp_path_factory.mktemp("bench") / "server.log"
    with running_server(tiny_omni_dir, log, "--no-warmup") as srv:
        yield srv


def _bench(server_url: str, *flags: str) -> subprocess.CompletedProcess:
    """`omnistage bench` as a user runs it, in a process of its own."""
    cmd = [sys.executable, "-m", "omnistage.entrypoints.cli", "bench", "--base-url", server_url,
           "--model", MODEL_NAME, *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _chat_ok(url: str) -> float:
    return metric(scrape(url), "omnistage_http_requests_total", endpoint="chat", status="ok")


def test_text_levels(server, tmp_path):
    out = tmp_path / "bench.json"
    before = _chat_ok(server.url)
    p = _bench(server.url, "--concurrency", "1,2", "--num-prompts", "3", "--max-tokens", "4",
               "--ignore-eos", "--warmup-rounds", "1", "--output", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(out.read_text())
    assert list(result["levels"]) == ["c1", "c2"] and result["warmup_errors"] == 0
    for c, level in zip((1, 2), result["levels"].values()):
        assert level["concurrency"] == c
        assert level["requests"] == level["completed"] == 3 and level["errors"] == 0
        assert level["text_tokens"] == 3 * 4  # eos ignored: every reply is max_tokens long
        assert level["requests_per_second"] > 0 and level["text_tokens_per_second"] > 0
        assert 0 < level["ttft_p50"] <= level["ttft_p90"] <= level["ttft_p99"]
        assert level["ttft_p99"] <= level["e2e_p99"] and level["tpot_p50"] > 0
        assert level["ttfa_p50"] is None and level["audio_seconds"] == 0  # text only
    # what the server counted: 2 warm-up requests (the largest level) and 2 x 3 measured
    assert _chat_ok(server.url) - before == 2 + 6
    assert "TTFT p50" in p.stdout and "TTFA p50" in p.stdout and f"wrote {out}" in p.stdout


def test_audio_level(server, tmp_path):
    out = tmp_path / "bench.json"
    p = _bench(server.url, "--concurrency", "2", "--max-tokens", "4", "--modalities", "audio",
               "--codes", "8", "--ignore-eos", "--warmup-rounds", "0", "--output", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    level = json.loads(out.read_text())["levels"]["c2"]
    assert level["requests"] == level["completed"] == 2 and level["errors"] == 0
    assert level["text_tokens"] == 2 * 4 and level["output_tokens"] > level["text_tokens"]
    assert level["audio_seconds"] > 0 and level["audio_seconds_per_second"] > 0
    assert 0 < level["ttfa_p50"] <= level["ttfa_p99"] and level["rtf_p50"] > 0


@pytest.mark.parametrize("flags,message", [
    (["--concurrency", "0"], "--concurrency: 0 is outside"),
    (["--num-prompts", "0"], "--num-prompts: 0 is outside"),
    (["--max-tokens", "-3"], "--max-tokens: -3 is outside"),
    (["--warmup-rounds", "-1"], "--warmup-rounds: must be >= 0"),
    (["--codes", "8"], "--codes: only with --modalities audio"),
    (["--base-url", "localhost:8000"], "--base-url: expected http(s)://host:port"),
    (["--request-timeout", "0"], "--request-timeout: must be > 0")])
def test_bad_flag_values(flags, message, capsys):
    assert main(["bench", "--model", "m", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--concurrency", "1,x"], "expected integers like 1,4,16"),
    (["--modalities", "video"], "invalid choice: 'video'"),
    ([], "the following arguments are required: --model")])
def test_bad_flags_rejected_by_the_parser(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *flags] if not flags else ["bench", "--model", "m", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_unusable_server_is_a_clear_error(server, capsys):
    assert main(["bench", "--base-url", server.url, "--model", "not-served"]) == 1
    err = capsys.readouterr().err
    assert "--model: 'not-served' is not served" in err and MODEL_NAME in err
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--model", MODEL_NAME]) == 1
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


def test_api_key_is_sent(tiny_omni_dir, tmp_path, capsys):
    llm = AsyncOmniLLM(str(tiny_omni_dir), device="cpu", max_model_len=256)
    try:
        config = ServerConfig(served_model_names=[MODEL_NAME], api_key="secret")
        with ThreadServer(build_app(llm, config)) as srv:
            base = ["bench", "--base-url", srv.url, "--model", MODEL_NAME, "--max-tokens", "2",
                    "--warmup-rounds", "0"]
            assert main(base) == 1
            assert "HTTP 401" in capsys.readouterr().err
            out = tmp_path / "bench.json"
            assert main([*base, "--api-key", "secret", "--output", str(out)]) == 0
            result = json.loads(out.read_text())
            assert result["levels"]["c1"]["completed"] == 1
            assert "api_key" not in result["config"]  # the key is not written out
    finally:
        llm.shutdown()


def test_audio_bytes_counted_from_base64_without_decoding():
    import base64

    from omnistage.entrypoints.bench import b64_bytes
    for n in (0, 1, 2, 3, 4, 479, 480, 4801):
        assert b64_bytes(base64.b64encode(bytes(n % 256 for _ in range(n))).decode()) == n
    with pytest.raises(ValueError, match="not a multiple of 4"):
        b64_bytes("abcde")
