"""Per-replica Prometheus series: a real `omnistage serve` of the tiny Qwen2.5-Omni with two
code2wav replicas exports {stage="code2wav", replica="0"|"1"} series whose counts add up to
the requests served."""

from __future__ import annotations

import asyncio

import openai
import yaml

from omnistage.config.schema import load_pipeline
from tests.entrypoints.server_utils import MODEL_NAME, metric, running_server, scrape

# a random model may end at once: some text, then some codes, for every request
STAGE_PARAMS = {"stage_sampling_params": {"thinker": {"min_tokens": 3},
                                          "talker": {"max_tokens": 24, "min_tokens": 8}}}
REQUESTS = 4


def replicated_pipeline(tmp_path) -> str:
    data = load_pipeline("qwen2_5_omni").model_dump(mode="json", exclude_defaults=True)
    assert data["stages"][2]["name"] == "code2wav"
    data["stages"][2].update(replicas=2, devices=["cpu", "cpu"])
    path = tmp_path / "replicas.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


async def speak_all(url: str) -> list[str | None]:
    """REQUESTS audio chats at once (least-loaded routing spreads requests that overlap)."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        async def one(i: int) -> str | None:
            r = await client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": f"Count to {i}."}],
                max_tokens=6, seed=i, modalities=["text", "audio"],
                audio={"voice": "Chelsie", "format": "wav"}, extra_body=STAGE_PARAMS)
            return r.choices[0].message.audio.data if r.choices[0].message.audio else None
        return await asyncio.gather(*(one(i) for i in range(REQUESTS)))


def test_replicated_stage_has_per_replica_series(tiny_omni_dir, tmp_path):
    # no warm-up request: every code2wav request counted here is one of ours
    with running_server(tiny_omni_dir, tmp_path / "server.log", "--pipeline",
                        replicated_pipeline(tmp_path), "--no-warmup") as srv:
        before = scrape(srv.url)
        assert metric(before, "omnistage_replica_requests_routed_total", stage="code2wav",
                      replica="0") == 0
        audio = asyncio.run(speak_all(srv.url))
        assert all(audio), "every request has audio"
        after = scrape(srv.url)
    replicas = ("0", "1")

    def per_replica(name: str) -> list[float]:
        return [metric(after, name, stage="code2wav", replica=r) for r in replicas]

    routed = per_replica("omnistage_replica_requests_routed_total")
    finished = per_replica("omnistage_replica_requests_finished_total")
    assert all(n > 0 for n in routed) and sum(routed) == REQUESTS, routed
    assert finished == routed  # each finished where it was routed
    assert per_replica("omnistage_replica_requests_failed_total") == [0, 0]
    assert per_replica("omnistage_replica_requests_aborted_total") == [0, 0]
    assert per_replica("omnistage_replica_requests_in_flight") == [0, 0]
    assert per_replica("omnistage_replica_errors_total") == [0, 0]
    steps = per_replica("omnistage_replica_steps_total")
    assert all(n > 0 for n in steps), steps
    assert all(s > 0 for s in per_replica("omnistage_replica_busy_seconds_total"))
    # the stage's own series are the replicas' sums; unreplicated stages get no replica series
    assert metric(after, "omnistage_stage_steps_total", stage="code2wav") == sum(steps)
    assert sum(v for (name, labels), v in after.items()
               if name == "omnistage_stage_requests_total"
               and dict(labels)["stage"] == "code2wav") == REQUESTS
    assert not any(name.startswith("omnistage_replica_") and dict(labels).get("stage") !=
                   "code2wav" for name, labels in after)
