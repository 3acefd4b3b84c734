"""Pipeline YAML validation: bad files fail at load, naming the field."""

import pytest
import yaml

from omnistage.config import load_pipeline
from omnistage.models.registry import check_registered

GOOD = {"name": "p", "stages": [
    {"name": "thinker", "kind": "ar", "model": "Qwen2_5OmniThinker", "output": "text"},
    {"name": "talker", "kind": "ar", "model": "Qwen2_5OmniTalker",
     "inputs": [{"upstream": "thinker", "adapter": "qwen2_5_omni_thinker_to_talker"}]},
    {"name": "code2wav", "kind": "gen", "model": "Qwen2_5OmniToken2Wav",
     "inputs": [{"upstream": "talker", "adapter": "qwen2_5_omni_talker_to_code2wav"}],
     "output": "audio"}]}


def test_builtin_pipelines_load():
    omni = load_pipeline("qwen2_5_omni")
    assert omni.stage_names == ["thinker", "talker", "code2wav"]
    assert omni.output_modalities == ["text", "audio"]
    assert omni.stage("talker").default_sampling.top_k == 40
    assert load_pipeline("llm").stage_names == ["llm"]
    assert load_pipeline(GOOD).stage_names == ["thinker", "talker", "code2wav"]


def bad(mutate):
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    mutate(data)
    return data


CASES = [
    ("unknown key", lambda d: d["stages"][0].update(colour="red"), r"stages\.0\.colour"),
    ("unknown engine key", lambda d: d["stages"][1].update(engine={"max_seqs": 4}),
     r"stages\.1\.engine\.max_seqs"),
    ("cycle", lambda d: d["stages"][0].update(
        inputs=[{"upstream": "talker", "adapter": "qwen2_5_omni_thinker_to_talker"}]),
     r"stages\[0\]\.inputs\[0\]\.upstream"),
    ("self loop", lambda d: d["stages"][1]["inputs"][0].update(upstream="talker"),
     r"stages\[1\]\.inputs\[0\]\.upstream"),
    ("missing upstream", lambda d: d["stages"][2]["inputs"][0].update(upstream="vocoder"),
     r"stages\[2\]\.inputs\[0\]\.upstream: no stage named 'vocoder'"),
    ("unknown adapter", lambda d: d["stages"][1]["inputs"][0].update(adapter="os.system"),
     r"stages\[1\]\.inputs\[0\]\.adapter"),
    ("unknown model", lambda d: d["stages"][0].update(model="evil.module.Class"),
     r"stages\[0\]\.model"),
    ("bad device", lambda d: d["stages"][0].update(device="tpu:0"), r"stages\.0\.device"),
    ("duplicate name", lambda d: d["stages"][2].update(name="thinker"), r"stages\[2\]\.name"),
    ("bad kind", lambda d: d["stages"][0].update(kind="diffusion"), r"stages\.0\.kind"),
    ("negative seqs", lambda d: d["stages"][0].update(engine={"max_num_seqs": 0}),
     r"stages\.0\.engine\.max_num_seqs"),
    ("tp in a stage process", lambda d: d["stages"][0].update(
        worker="process", tensor_parallel_size=2, devices=["cuda:0", "cuda:1"]),
     r"worker: 'process' cannot hold a tensor-parallel stage"),
]


@pytest.mark.parametrize("label,mutate,field", CASES, ids=[c[0] for c in CASES])
def test_invalid_pipeline_names_the_field(tmp_path, label, mutate, field):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(bad(mutate)))
    with pytest.raises(ValueError, match=field):
        check_registered(load_pipeline(str(path)))  # names are checked where stages are built


def test_not_yaml_and_missing_file(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("stages: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_pipeline(str(path))
    with pytest.raises(ValueError, match="neither a YAML file nor a built-in"):
        load_pipeline(str(tmp_path / "missing.yaml"))


def test_stage_engine_options_reach_the_engine(tiny_omni_dir, tmp_path):
    from omnistage import OmniLLM
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["stages"][0]["engine"] = {"max_num_seqs": 3, "block_size": 8}
    data["stages"][1]["default_sampling"] = {"max_tokens": 7}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    llm = OmniLLM(str(tiny_omni_dir), pipeline=str(path))
    assert llm.pipeline.engines["thinker"].config.max_num_seqs == 3
    assert llm.pipeline.engines["thinker"].config.block_size == 8
    assert llm.pipeline.default_params["talker"].max_tokens == 7
    llm.shutdown()


def test_distributed_docs_yaml_validates():
    """Every YAML block of docs/distributed.md is a whole pipeline that loads (schema, graph,
    registered names), so the documented deployments cannot drift from the schema."""
    import re
    from pathlib import Path
    text = (Path(__file__).parents[2] / "docs" / "distributed.md").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) >= 5, "the TP, replica, 2-GPU and 2-node examples"
    layouts = {}
    for block in blocks:
        cfg = load_pipeline(yaml.safe_load(block))
        check_registered(cfg)
        layouts[cfg.name] = {s.name: (s.tp_size, s.replica_devices()) for s in cfg.stages}
    assert layouts["qwen2_5_omni_2gpu"] == {"thinker": (1, [["cuda:0"]]),
                                            "talker": (1, [["cuda:1"]]),
                                            "code2wav": (1, [["cuda:1"]])}
    assert layouts["qwen3_omni_tp2"]["thinker"] == (2, [["cuda:0", "cuda:1"]])
    assert layouts["qwen2_5_omni_code2wav_x2"]["code2wav"] == (1, [["cuda:0"], ["cuda:1"]])
    ray = load_pipeline(yaml.safe_load(next(b for b in blocks if "qwen2_5_omni_2node" in b)))
    assert all(s.worker == "ray" for s in ray.stages)
    assert [s.placement.resources for s in ray.stages] == [{"node_a": 1}, {"node_b": 0.5},
                                                           {"node_b": 0.5}]
