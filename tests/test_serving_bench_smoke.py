"""CPU smoke test of benchmarks/serving.py, the headline benchmark: the server over HTTP and
the engine in-process on the embedded tiny model, every request of each level completed on
both sides, the per-level numbers and the server-over-engine ratios written."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    # compile caches of its own, empty (compile_caches_empty: not what other tests left)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    return subprocess.run([sys.executable, "-m", "benchmarks.serving", "--concurrency", "1,2",
                           "--max-tokens", "4", "--codes", "16", "--warmup-rounds", "0",
                           "--server-log", str(tmp_path / "server.log"), *extra],
                          capture_output=True, text=True, timeout=300, env=env)


def test_both_sides_serve_every_request(tmp_path):
    out = tmp_path / "serving.json"
    proc = run(tmp_path, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    for side in ("server", "engine"):
        for level, n in (("c1", 1), ("c2", 2)):
            row = result[side][level]
            assert row["completed"] == n and row["errors"] == 0, (side, level, row)
            assert row["audio_seconds"] > 0 and row["ttfa_p50"] > 0, (side, level, row)
            assert row["runtime_ttft_mean"] is not None, (side, level, row)
        assert result[side]["first_request"]["audio_s"] > 0
    assert result["engine"]["switch_interval_ms"] == 5.0  # (Python's: AsyncOmniLLM keeps it)
    assert result["server"]["startup_to_health_s"] > 0
    assert result["server"]["c2"]["server_ttfa_mean"] is not None  # from the server's /metrics
    assert set(result["server_over_engine"]["c2"]) >= {"ttfa_p50", "audio_seconds_per_second"}


def test_engine_side_switch_interval(tmp_path):
    """--engine-switch-interval-ms sets the engine side's GIL switch interval once it is built
    (as the server sets its own), and the result says which one it ran at."""
    out = tmp_path / "engine.json"
    proc = run(tmp_path, "--side", "engine", "--concurrency", "1",
               "--engine-switch-interval-ms", "0.5", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["engine"]["switch_interval_ms"] == 0.5
    assert result["engine"]["c1"]["completed"] == 1
    bad = run(tmp_path, "--side", "engine", "--engine-switch-interval-ms", "0")
    assert bad.returncode == 2 and "--engine-switch-interval-ms: 0.05..100.0" in bad.stderr


def test_a_missing_py_spy_is_named(tmp_path):
    proc = run(tmp_path, "--py-spy", str(tmp_path / "stacks"), "--py-spy-exe",
               str(tmp_path / "no-such-py-spy"))
    assert proc.returncode == 2
    assert "--py-spy-exe" in proc.stderr
    proc = run(tmp_path, "--py-spy-startup")  # (sampling the start needs a place for stacks)
    assert proc.returncode == 2
    assert "--py-spy-startup" in proc.stderr
    proc = run(tmp_path, "--starts", "0")
    assert proc.returncode == 2
    assert "--starts: 1..20, got 0" in proc.stderr


def test_unstreamed_repeated_rounds_on_pinned_cpus(tmp_path):
    """--no-stream (the runtime's TTFT / TTFA without SSE), --repeats (each round kept, and
    their median) and the CPU pinning of the server and the load generator."""
    import os
    cpus = sorted(os.sched_getaffinity(0))
    out = tmp_path / "serving.json"
    proc = run(tmp_path, "--side", "server", "--no-stream", "--repeats", "2",
               "--server-cpus", str(cpus[0]), "--client-cpus", str(cpus[-1]), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["server"]["cpus"] == [cpus[0]]  # (the server process's own affinity)
    assert result["client_cpus"] == [cpus[-1]]
    row = result["server"]["c2"]
    assert row["completed"] == 2 and row["errors"] == 0, row
    assert row["audio_seconds"] > 0 and row["ttfa_p50"] is None  # (nothing streamed)
    assert len(row["rounds"]) == 2
    assert all(r["runtime_ttfa_mean"] > 0 for r in row["rounds"]), row["rounds"]
    assert row["median_of_rounds"]["runtime_ttfa_mean"] > 0


def test_bad_cpu_lists_are_named(tmp_path):
    for flag, value, named in (("--server-cpus", "3-1", "'3-1' is not a CPU"),
                               ("--client-cpus", "99999", "CPUs [99999] are not available"),
                               ("--server-cpus", "a", "'a' is not a CPU")):
        proc = run(tmp_path, flag, value)
        assert proc.returncode == 2, (flag, value)
        assert "--server-cpus / --client-cpus" in proc.stderr and named in proc.stderr, \
            proc.stderr


def test_alternating_starts(tmp_path):
    """--starts 2: server, engine, engine, server (the engine side in a process of its own
    each time), the median over starts per side, and each pair's server / engine ratios."""
    out = tmp_path / "serving.json"
    proc = run(tmp_path, "--starts", "2", "--concurrency", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [s["side"] for s in result["starts"]] == ["server", "engine", "engine", "server"]
    for start in result["starts"]:
        row = start["c1"]
        assert row["completed"] == 1 and row["errors"] == 0, (start["side"], row)
        assert row["audio_seconds"] > 0
    for side in ("server", "engine"):
        assert result["median_of_starts"][side]["c1"]["ttfa_p50"] > 0
    assert len(result["server_over_engine_per_pair"]) == 2
    assert result["server_over_engine"]["c1"]["ttfa_p50"] > 0
    # (the tiny model on a CPU compiles nothing: every start found the caches empty)
    assert [s["compile_caches_empty"] for s in result["starts"]] == [True] * 4
    assert [p["compile_caches_empty"] for p in result["server_over_engine_per_pair"]] == \
        [True, True]
    assert "server" not in result and "engine" not in result  # (each start is in "starts")


def test_server_argument_ab(tmp_path):
    """--server-arg-b with --side server --starts 2: variants A, B, B, A (B's starts with the
    extra argument, which reaches the server: its log says so), each one's median over its
    starts, and B over A from those and per pair."""
    out = tmp_path / "serving.json"
    proc = run(tmp_path, "--side", "server", "--starts", "2", "--concurrency", "1",
               "--server-arg-b=--switch-interval-ms=5", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    starts = result["starts"]
    assert [s["side"] for s in starts] == ["server", "server_b", "server_b", "server"]
    for start in starts:
        assert start["c1"]["completed"] == 1 and start["c1"]["errors"] == 0, start["side"]
        b = start["side"] == "server_b"
        assert ("--switch-interval-ms=5" in start["server_args"]) == b
        log = (tmp_path / start["server_log"]).read_text()
        assert f"GIL switch interval: {5 if b else 0.5} ms" in log, start["server_log"]
    for side in ("server", "server_b"):
        assert result["median_of_starts"][side]["c1"]["ttfa_p50"] > 0
    assert result["b_over_a"]["c1"]["ttfa_p50"] > 0 and len(result["b_over_a_per_pair"]) == 2
    proc = run(tmp_path, "--starts", "2", "--server-arg-b=--switch-interval-ms=5")
    assert proc.returncode == 2 and "--server-arg-b: needs --side server" in proc.stderr


def test_medians_leave_out_starts_on_empty_compile_caches():
    """A fresh machine's first start compiles every kernel (once per machine, and only for the
    side that starts first): the medians are over the starts that found the caches filled,
    and over all when none did."""
    from benchmarks.serving import measured
    cold = {"compile_caches_empty": True, "c32": {"ttfa_p50": 0.9}}
    warm = [{"compile_caches_empty": False, "c32": {"ttfa_p50": t}} for t in (0.4, 0.5)]
    assert measured([cold, *warm]) == warm
    assert measured([cold]) == [cold]

