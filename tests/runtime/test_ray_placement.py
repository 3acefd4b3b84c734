"""Ray placement on a 2-node cluster on loopback (node_a: the head, node_b: a second `ray start`):
the tiny Qwen2.5-Omni pipeline with its stages on different nodes gives the in-process results,
a killed stage actor fails only the requests it held and is re-placed, and no Ray socket leaves
loopback. Every blocking step is bounded: `ray start` has a timeout, the LLM a request timeout,
and a module watchdog kills the cluster's workers (so every call on an actor fails, and the
requests with it) if the module overruns; the GCS stays up, as a driver that loses it exits
on the spot (no report, no teardown)."""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from omnistage import OmniLLM, SamplingParams
from omnistage.config.schema import load_pipeline
from omnistage.runtime.ray_placement import RayStage, check_ray_address, placement_options
from omnistage.testing.tiny_omni import TINY_TALKER_EOS, tiny_omni_test_messages

ray = pytest.importorskip("ray", reason="Ray is not installed (the `ray` extra)")

# the module's budget: past WATCHDOG_S the actors are killed, every WATCHDOG_REPEAT_S again
# (actor calls fail, tests fail); past HARD_EXIT_S the process dumps its threads and exits
WATCHDOG_S, WATCHDOG_REPEAT_S, HARD_EXIT_S = 150.0, 5.0, 270.0
REQUEST_TIMEOUT_S = 60.0


def speech_params(codes: int, seed: int) -> dict:
    return {"thinker": SamplingParams(temperature=0.8, top_k=50, max_tokens=8, min_tokens=8,
                                      seed=seed),
            "talker": SamplingParams(temperature=0.9, top_k=40, top_p=0.8,
                                     repetition_penalty=1.05, max_tokens=codes, min_tokens=codes,
                                     stop_token_ids=TINY_TALKER_EOS, suppress_token_ids=[121],
                                     seed=seed)}


PROMPTS = [{"messages": tiny_omni_test_messages()[k]} for k in ("text_only", "audio_text")]
PARAMS = [speech_params(30 + 10 * i, seed=i) for i in range(len(PROMPTS))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Watchdog:
    """Kills the cluster's workers when the module overruns (and again while it runs on: a
    re-placed stage gets new ones): a hung wait for an actor then fails."""

    def __init__(self, cluster, seconds: float) -> None:
        self.cluster, self.fired, self.done = cluster, threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._watch, args=(seconds,), daemon=True)
        self.thread.start()
        faulthandler.dump_traceback_later(HARD_EXIT_S, exit=True)

    def _watch(self, seconds: float) -> None:
        if self.done.wait(seconds):
            return
        self.fired.set()
        print(f"ray test watchdog: over {seconds} s; killing the actors", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr)
        while not self.done.is_set():
            self.cluster.kill_workers()
            self.done.wait(WATCHDOG_REPEAT_S)

    def cancel(self) -> None:
        self.done.set()
        self.thread.join(timeout=10)
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def cluster():
    from tests.runtime import ray_loopback
    temp_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: unix socket paths
    try:  # node_a: the head (GCS, and room for stages); node_b: a second node
        c = ray_loopback.LoopbackCluster(temp_dir, free_port(), num_cpus=2,
                                         resources={"node_a": 2})
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        shutil.rmtree(temp_dir, ignore_errors=True)
        pytest.fail(f"Ray cannot start a loopback cluster here: {e}")
    dog = Watchdog(c, WATCHDOG_S)
    try:
        c.add_node("node_b", num_cpus=2, resources={"node_b": 2})
        ray_loopback.loopback()
        ray.init(address=c.address, _node_ip_address="127.0.0.1", include_dashboard=False,
                 log_to_driver=False)
        yield c
        assert not dog.fired.is_set(), f"the module ran over {WATCHDOG_S} s"
    finally:
        dog.cancel()
        if ray.is_initialized():
            ray.shutdown()
        c.stop()  # by pid: only this cluster's processes (`ray stop` stops every Ray here)
        shutil.rmtree(temp_dir, ignore_errors=True)


def node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


@pytest.fixture(scope="module")
def reference(tiny_omni_dir):
    """In-process, on 1 torch thread: as the actors (Ray sets OMP_NUM_THREADS to an actor's
    CPUs), so both sum in the same order (on 2 threads a near-tie talker code flips)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with OmniLLM(str(tiny_omni_dir), device="cpu") as llm:
            return llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_llm(cluster, tiny_omni_dir, tmp_path_factory):
    """thinker on node_a, talker on node_b, code2wav as 2 replicas wherever Ray has room."""
    data = load_pipeline("qwen2_5_omni").model_dump(mode="json", exclude_defaults=True)
    assert [s["name"] for s in data["stages"]] == ["thinker", "talker", "code2wav"]
    data["stages"][0].update(worker="ray", placement={"num_cpus": 1,
                                                      "resources": {"node_a": 1}})
    data["stages"][1].update(worker="ray", placement={"num_cpus": 1,
                                                      "resources": {"node_b": 1}})
    data["stages"][2].update(worker="ray", replicas=2, placement={"num_cpus": 0.5})
    path = tmp_path_factory.mktemp("yaml") / "ray.yaml"
    path.write_text(yaml.safe_dump(data))
    llm = OmniLLM(str(tiny_omni_dir), device="cpu", pipeline=str(path),
                  ray_address=cluster.address, request_timeout=REQUEST_TIMEOUT_S)
    yield llm
    llm.shutdown()


def same(a, b) -> None:
    assert a.error is None and b.error is None, (a.error, b.error)
    assert b.token_ids == a.token_ids
    codes = b.stages["talker"].token_ids
    assert codes == a.stages["talker"].token_ids and len(codes) > 0
    assert b.audio.shape == a.audio.shape and float(np.abs(a.audio).max()) > 1e-3
    diff = float(np.abs(b.audio - a.audio).max())
    assert diff < 2e-3, diff


def test_stages_on_different_nodes_equal_in_process(cluster, ray_llm, reference):
    remote = ray_llm.runtime.remote
    assert set(remote) == {"thinker", "talker", "code2wav/0", "code2wav/1"}
    assert all(isinstance(s, RayStage) for s in remote.values())
    assert ray_llm.pipeline.workers == {}  # nothing runs in this process
    t0 = time.monotonic()
    outs = ray_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert time.monotonic() - t0 < REQUEST_TIMEOUT_S
    for a, b in zip(reference, outs, strict=True):
        same(a, b)
    # each stage in an actor process of its own, on the node its placement names
    assert remote["thinker"].node_id == node_with("node_a")
    assert remote["talker"].node_id == node_with("node_b") != node_with("node_a")
    assert len({s.pid for s in remote.values()} | {os.getpid()}) == 5
    stats = ray_llm.runtime.refresh_stats()
    # thinker -> talker: actor to actor through the object store (data calls)
    assert stats["talker"]["link_messages"] > 0 and stats["code2wav"]["steps"] > 0
    served = [r["routed"] for r in ray_llm.runtime.replica_stats()["code2wav"]]
    assert served == [1.0, 1.0], served  # both replicas served


def test_killed_actor_fails_only_its_requests_and_is_replaced(cluster, ray_llm, reference):
    runtime = ray_llm.runtime
    runtime.set_step_delay("code2wav", 0.3)  # keep the requests in code2wav when it dies
    runtime.trace = []
    victim = runtime.remote["code2wav/0"]
    killed_pid, held = victim.pid, {}

    def kill_when_both_are_in_code2wav() -> None:
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while time.monotonic() < deadline:
            rids = {rid for _, rid, _, _ in list(runtime.trace)}
            where = {rid: runtime.replica_of("code2wav", rid) for rid in rids}
            talked = {rid for st, rid, n, _ in list(runtime.trace) if st == "talker" and n >= 10}
            if len(rids) == 2 and talked == rids and set(where.values()) == {0, 1}:
                held.update(where)
                os.kill(killed_pid, signal.SIGKILL)  # the stage actor's process, on its node
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_when_both_are_in_code2wav, daemon=True)
    killer.start()
    t0 = time.monotonic()
    outs = ray_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    killer.join(timeout=5)
    assert held, "the kill never happened (requests not spread over both replicas)"
    assert time.monotonic() - t0 < REQUEST_TIMEOUT_S
    for ref, out in zip(reference, outs, strict=True):
        assert out.finished
        if held[out.request_id] == 0:  # on the killed actor: a clear error, no hang
            assert out.error and "code2wav/0" in out.error and "Ray actor was lost" \
                in out.error, out.error
        else:  # on the other replica: untouched
            same(ref, out)
    assert runtime.stage_errors == {"thinker": 0, "talker": 0, "code2wav": 1}
    assert victim.restarts == 1 and runtime.remote["code2wav/1"].restarts == 0
    # re-placed: a new actor (process) serves the stage's following requests
    runtime.set_step_delay("code2wav", 0.0)
    again = ray_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for ref, out in zip(reference, again, strict=True):
        same(ref, out)
    assert victim.ready and victim.pid not in (None, killed_pid)
    assert [r["routed"] for r in runtime.replica_stats()["code2wav"]][0] >= 1


def test_no_ray_socket_leaves_loopback(cluster, ray_llm):
    from tests.runtime.ray_loopback import ray_sockets
    pids = cluster.pids() | {os.getpid()} | {s.pid for s in ray_llm.runtime.remote.values()}
    sockets = ray_sockets(pids)
    connected = [s for s in sockets if s.state == "ESTAB"]
    assert len(connected) >= 10, sockets  # the GCS, raylets, workers and driver talk
    listening = [s for s in sockets if s.state == "LISTEN"]
    assert len(listening) >= 5, sockets  # the GCS, 2 raylets (2 ports each), the workers'
    # every connection: both ends on loopback; every listener bound to loopback (not to the
    # wildcard address, where another machine could reach it)
    off = [s for s in connected if not (s.local_loopback and s.peer_loopback)]
    off += [s for s in listening if not s.local_loopback]
    assert off == [], off


def test_ray_options_are_validated():
    cfg = load_pipeline("qwen2_5_omni")
    for bad in ("", "host", "host:0", "h:99999", 7):
        with pytest.raises(ValueError, match="ray_address"):
            check_ray_address(bad)
    assert check_ray_address("auto") == "auto" and check_ray_address("ray://h:10001")
    data = cfg.model_dump(mode="json", exclude_defaults=True)
    data["stages"][2]["worker"] = "ray"
    with pytest.raises(ValueError, match=r"stages\[2\]\.worker"):
        placement_options(load_pipeline(data), {})
    with pytest.raises(ValueError, match="stage_worker"):
        placement_options(cfg, {"stage_worker": "ray"})
    assert placement_options(cfg, {"max_num_seqs": 4}) == {"max_num_seqs": 4}


class _Built(Exception):
    """Raised by the stand-in engine: serve stops there, before any server starts."""


def test_serve_ray_address_flag_reaches_the_engine(tiny_omni_dir, monkeypatch, capsys):
    from omnistage.entrypoints import async_llm
    from omnistage.entrypoints.cli import build_parser, main
    seen: dict = {}

    def engine(model, **kwargs):
        seen.update(kwargs, model=model)
        raise _Built

    monkeypatch.setattr(async_llm, "AsyncOmniLLM", engine)
    for value in ("127.0.0.1:6379", "auto", "ray://10.0.0.2:10001"):
        seen.clear()
        with pytest.raises(_Built):
            main(["serve", str(tiny_omni_dir), "--ray-address", value, "--no-warmup"])
        assert seen["ray_address"] == value and seen["model"] == str(tiny_omni_dir)
    seen.clear()
    with pytest.raises(_Built):  # without the flag: no ray_address at all (in-process stages)
        main(["serve", str(tiny_omni_dir)])
    assert "ray_address" not in seen
    assert build_parser().parse_args(["serve"]).ray_address is None
    for bad in ("", "host", "h:0", "h:70000", "h:port"):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", str(tiny_omni_dir), "--ray-address", bad])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "--ray-address" in err and "HOST:PORT" in err, err


def test_diffusion_pipeline_refuses_ray_address(tmp_path):
    from omnistage.testing.tiny_z_image import build_tiny_z_image
    path = build_tiny_z_image(tmp_path / "z_image")
    # refused before any Ray is joined (nothing listens at this address)
    with pytest.raises(ValueError, match=r"ray_address: Z-Image \(diffusion\) pipelines"):
        OmniLLM(str(path), device="cpu", ray_address="127.0.0.1:9")
    with OmniLLM(str(path), device="cpu") as llm:  # without it: the image pipeline as ever
        assert llm.pipeline.output_modalities == ["image"]
