"""Ray placement on a 2-node cluster on loopback: code2wav as a Ray actor on the second node
gives the in-process results, no Ray socket leaves loopback, and a lost node fails the
requests its stage held; the stage is re-placed and serves again."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
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

STAGE_HOST = "omnistage_gen"  # the custom resource only the second node (and its stand-in) has


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


@pytest.fixture(scope="module")
def cluster():
    from tests.runtime import ray_loopback
    temp_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: unix socket paths
    try:
        c = ray_loopback.LoopbackCluster(temp_dir, free_port())
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        shutil.rmtree(temp_dir, ignore_errors=True)
        pytest.skip(f"Ray cannot start here: {e}")
    try:
        c.add_node("node2", resources={STAGE_HOST: 1})
        ray_loopback.loopback()
        ray.init(address=c.address, _node_ip_address="127.0.0.1", include_dashboard=False,
                 log_to_driver=False)
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


@pytest.fixture(scope="module")
def reference(tiny_omni_dir):
    with OmniLLM(str(tiny_omni_dir), device="cpu") as llm:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def ray_llm(cluster, tiny_omni_dir, tmp_path_factory):
    data = load_pipeline("qwen2_5_omni").model_dump(mode="json", exclude_defaults=True)
    data["stages"][2].update(worker="ray", placement={"num_cpus": 1,
                                                      "resources": {STAGE_HOST: 1}})
    path = tmp_path_factory.mktemp("yaml") / "ray.yaml"
    path.write_text(yaml.safe_dump(data))
    llm = OmniLLM(str(tiny_omni_dir), device="cpu", pipeline=str(path),
                  ray_address=cluster.address)
    yield llm
    llm.shutdown()


def same(a, b) -> None:
    assert a.error is None and b.error is None, (a.error, b.error)
    assert b.token_ids == a.token_ids
    codes = b.stages["talker"].token_ids
    assert codes == a.stages["talker"].token_ids and len(codes) > 0
    assert b.audio.shape == a.audio.shape and float(np.abs(a.audio).max()) > 1e-3
    # the actor runs code2wav on 1 thread, in-process 2: fp32 summation order differs
    diff = float(np.abs(b.audio - a.audio).max())
    assert diff < 2e-3, diff


@pytest.mark.skip(reason="the 2-node loopback cluster hung this suite on the 2-core CI machine "
                  "(2026-11-28); run by hand until that is understood")
def test_stage_on_second_node_equals_in_process(cluster, ray_llm, reference):
    stage = ray_llm.runtime.remote["code2wav"]
    assert isinstance(stage, RayStage) and set(ray_llm.pipeline.workers) == {"thinker", "talker"}
    outs = ray_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for a, b in zip(reference, outs, strict=True):
        same(a, b)
    # the actor ran on the second node, in a process of its own, fed through the object store
    assert stage.ready and stage.node_id == node_with(STAGE_HOST) != node_with("head")
    assert ray_llm.runtime.refresh_stats()["code2wav"]["link_messages"] == 0  # (via driver)
    assert ray_llm.runtime.stats()["code2wav"]["steps"] > 0
    # network rule: every socket of the cluster and of this driver is on loopback
    from tests.runtime.ray_loopback import sockets_off_loopback
    assert sockets_off_loopback(cluster.pids() | {os.getpid()}) == []


@pytest.mark.skip(reason="the 2-node loopback cluster hung this suite on the 2-core CI machine "
                  "(2026-11-28); run by hand until that is understood")
def test_lost_node_fails_its_requests_and_stage_is_replaced(cluster, ray_llm, reference):
    runtime = ray_llm.runtime
    stage = runtime.remote["code2wav"]
    runtime.set_step_delay("code2wav", 1.0)  # keep the requests in code2wav when the node goes
    runtime.trace = []
    killed = threading.Event()

    def kill_when_audio_is_due() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(st == "talker" and n >= 10 for st, _, n, _ in list(runtime.trace)):
                cluster.kill_node("node2")
                killed.set()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_audio_is_due)
    killer.start()
    t0 = time.monotonic()
    outs = ray_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    killer.join()
    assert killed.is_set()
    for out in outs:  # the lost stage's requests fail with an error (no hang)
        assert out.finished and out.error and "Ray actor was lost" in out.error, out.error
    assert time.monotonic() - t0 < 60
    assert runtime.stage_errors["code2wav"] == 1 and stage.restarts == 1
    # re-placed: it waits for room in the cluster, which a new node brings
    runtime.set_step_delay("code2wav", 0.0)
    cluster.add_node("node3", resources={STAGE_HOST: 1})
    again = ray_llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
    same(reference[0], again[0])
    assert stage.node_id == node_with(STAGE_HOST)


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
