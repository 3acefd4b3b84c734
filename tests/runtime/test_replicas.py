"""Stage replicas: two code2wav replicas give the single-replica pipeline's results, both serve,
routing is least-loaded and sticky, and a replica that fails fails only its own requests."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from omnistage import OmniLLM
from omnistage.config.schema import load_pipeline
from omnistage.runtime.replicas import ReplicaSet, unit_name
from omnistage.testing.tiny_omni import tiny_omni_test_messages
from tests.runtime.test_process_stages import speech_params


def replicated_yaml(tmp_path, **code2wav) -> str:
    data = load_pipeline("qwen2_5_omni").model_dump(mode="json", exclude_defaults=True)
    data["stages"][2].update(code2wav)
    path = tmp_path / "replicas.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


PROMPTS = [{"messages": tiny_omni_test_messages()[k]}
           for k in ("text_only", "audio_text", "image_text", "text_only")]
PARAMS = [speech_params(10, 30 + 8 * i, seed=i) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def reference(tiny_omni_dir):
    with OmniLLM(str(tiny_omni_dir), device="cpu") as llm:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def same(a, b) -> None:
    assert a.error is None and b.error is None, (a.error, b.error)
    assert b.token_ids == a.token_ids and b.text == a.text
    codes = b.stages["talker"].token_ids
    assert codes == a.stages["talker"].token_ids and len(codes) > 0
    assert b.audio.shape == a.audio.shape == (len(codes) * 480,)
    assert float(np.abs(a.audio).max()) > 1e-3  # not silence
    assert np.abs(b.audio - a.audio).max() < 1e-4


def test_two_code2wav_replicas_equal_one(tiny_omni_dir, tmp_path, reference):
    yaml_path = replicated_yaml(tmp_path, replicas=2, devices=["cpu", "cpu"])
    with OmniLLM(str(tiny_omni_dir), device="cpu", pipeline=yaml_path) as llm:
        assert set(llm.pipeline.workers) == {"thinker", "talker", "code2wav/0", "code2wav/1"}
        assert isinstance(llm.runtime.hosts["code2wav"], ReplicaSet)
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        per_replica = llm.runtime.replica_stats()["code2wav"]
        total = llm.runtime.stats()["code2wav"]
    for a, b in zip(reference, outs, strict=True):
        same(a, b)
    # both replicas served (4 requests at once: least-loaded routing alternates) ...
    assert [s["routed"] for s in per_replica] == [2.0, 2.0]
    assert all(s["steps"] > 0 for s in per_replica), per_replica
    assert all(s["holding"] == 0 for s in per_replica)  # ... and released every request
    assert total["steps"] == sum(s["steps"] for s in per_replica) and total["replicas"] == 2


def test_failing_replica_fails_only_its_requests(tiny_omni_dir, tmp_path, reference):
    yaml_path = replicated_yaml(tmp_path, replicas=2)
    with OmniLLM(str(tiny_omni_dir), device="cpu", pipeline=yaml_path) as llm:
        broken = llm.pipeline.workers["code2wav/1"]

        def crash(*args, **kwargs):
            raise RuntimeError("replica 1 is broken")

        broken.step = broken.launch = crash
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        per_replica = llm.runtime.replica_stats()["code2wav"]
        served = [s["routed"] for s in per_replica]
        assert llm.runtime.unit_errors["code2wav/1"] > 0 and \
            llm.runtime.unit_errors["code2wav/0"] == 0
    assert served == [2.0, 2.0]
    # how they left: replica 0 finished its two, replica 1 failed its two
    assert [(s["finished"], s["failed"], s["aborted"], s["holding"]) for s in per_replica] == \
        [(2.0, 0.0, 0.0, 0.0), (0.0, 2.0, 0.0, 0.0)]
    # routing alternates: requests 0 and 2 on replica 0 (fine), 1 and 3 on replica 1 (failed)
    for i, (a, b) in enumerate(zip(reference, outs, strict=True)):
        if i % 2 == 0:
            same(a, b)
        else:
            assert b.finished and b.error and "replica 1 is broken" in b.error


def test_routing_is_least_loaded_and_sticky():
    class Host:
        name = "s"

        def __init__(self):
            self.got: list[tuple] = []

        def submit(self, rid, request, links):
            self.got.append(("submit", rid))

        def receive(self, rid, index, msg):
            self.got.append(("data", rid, msg))

        def abort(self, rid):
            self.got.append(("abort", rid))

        def stats(self):
            return {"steps": 1.0, "max_batch_size": 3.0}

    a, b, c = Host(), Host(), Host()
    rs = ReplicaSet("s", [a, b, c])
    for rid in ("r0", "r1", "r2", "r3"):
        rs.submit(rid, None, [])
    assert [x[1] for x in a.got] == ["r0", "r3"] and [x[1] for x in b.got] == ["r1"]
    rs.release("r1")  # finished on replica 1: it is the least loaded again (with replica 2)
    rs.submit("r4", None, [])
    assert b.got[-1] == ("submit", "r4")
    rs.receive("r3", 0, "chunk")  # sticky: a request's later data goes to its replica
    rs.receive("r2", 0, "chunk")
    assert a.got[-1] == ("data", "r3", "chunk") and c.got[-1] == ("data", "r2", "chunk")
    rs.abort("r3")
    assert a.got[-1] == ("abort", "r3") and rs.load == [1, 1, 1]
    rs.release("r4", failed=True)
    rs.abort("r4")  # finished here already: nothing to abort
    assert b.got[-1] == ("submit", "r4") and rs.load == [1, 0, 1]
    rs.release("r0")
    assert [(s["routed"], s["holding"], s["finished"], s["failed"], s["aborted"])
            for s in rs.replica_stats()] == [(2, 0, 1, 0, 1), (2, 0, 1, 1, 0), (1, 1, 0, 0, 0)]
    assert rs.stats()["steps"] == 3.0 and rs.stats()["max_batch_size"] == 3.0
    assert rs.stats()["routed"] == 5.0 and rs.stats()["finished"] == 2.0
    assert unit_name("code2wav", 1, 2) == "code2wav/1" and unit_name("talker", 0, 1) == "talker"
    with pytest.raises(ValueError, match="at least 2"):
        ReplicaSet("s", [a])
