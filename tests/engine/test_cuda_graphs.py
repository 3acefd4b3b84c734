"""CUDA-graph decode path: the same tokens as the eager CPU path (fp32), greedy and seeded
sampling, for a plain LM (1-D rope) and a talker-like model (mrope, replacement + additive rows,
padded batches). GPU tests are skipped without CUDA; the size ladder is checked on CPU."""

import pytest
import torch

from omnistage.engine.ar.cuda_graphs import graph_batch_sizes
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.scheduler import EngineConfig
from omnistage.engine.ar.sequence import Sequence
from omnistage.models.layers import DecoderForCausalLM
from omnistage.models.qwen2_5_omni.talker import Qwen2_5OmniTalkerForCausalLM
from omnistage.sampling_params import SamplingParams
from omnistage.testing.input_rows import RandomInputRows
from omnistage.testing.tiny_lm import scale_weights_

LM_CFG = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
              max_position_embeddings=4096, tie_word_embeddings=False)
TALKER_CFG = dict(LM_CFG, embedding_size=48, rope_parameters=dict(
    rope_theta=1e4, rope_type="default", mrope_section=[2, 3, 3]),
    tts_codec_start_token_id=290, tts_codec_end_token_id=291, tts_codec_pad_token_id=292,
    tts_codec_mask_token_id=293, tts_text_start_token_id=1, tts_text_end_token_id=2,
    tts_text_pad_token_id=3)


def test_graph_batch_sizes():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]


def _run(model, device, prompts, params, talker: bool, graphs: bool, max_num_seqs: int = 8):
    cfg = EngineConfig(max_model_len=256, max_num_seqs=max_num_seqs, block_size=8,
                       max_num_batched_tokens=64, cuda_graphs="auto" if graphs else "off")
    eng = AREngine(model, cfg, device, torch.float32)
    for i, p in enumerate(prompts):
        kw = talker_inputs(model, p, i, device) if talker else {}
        eng.add_request(Sequence(f"r{i}", p, params, seed=1000 + i, **kw))
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for u in eng.step():
            out.setdefault(u.request_id, []).extend(u.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))], eng


def talker_inputs(model, prompt: list[int], i: int, device) -> dict:
    """Sequence kwargs of a talker-like request: mrope positions, seeded input rows (the
    prompt's replace the token embeddings, later ones are added), not prefix-cacheable."""
    width = model.model.embed_tokens.weight.shape[1]
    return dict(mrope_positions=torch.arange(len(prompt)).expand(3, -1) * torch.tensor(
        [[1], [2], [3]]), rope_delta=5,
        input_source=RandomInputRows(len(prompt), width, i, device), cacheable=False)


def cpu_model(talker: bool):
    """The tiny LM or talker-like model, seeded weights, fp32 on the CPU."""
    torch.manual_seed(0)
    m = Qwen2_5OmniTalkerForCausalLM(TALKER_CFG) if talker else DecoderForCausalLM(LM_CFG)
    scale_weights_(m, 0.2)
    return m.eval()


def _models(talker: bool):
    m = cpu_model(talker)
    gpu = type(m)(TALKER_CFG if talker else LM_CFG)
    gpu.load_state_dict(m.state_dict())
    return m, gpu.cuda().eval()


@pytest.mark.gpu
@pytest.mark.parametrize("talker", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_graph_decode_matches_cpu(talker, sampled):
    cpu_model, gpu_model = _models(talker)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 280, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 3)]
    params = (SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.1,
                             max_tokens=14, ignore_eos=True) if sampled else
              SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    ref, _ = _run(cpu_model, torch.device("cpu"), prompts, params, talker, graphs=False)
    got, eng = _run(gpu_model, torch.device("cuda"), prompts, params, talker, graphs=True)
    assert eng.runner.graphs is not None and eng.runner.graphs.graphs, "no graph was replayed"
    assert {k[0] for k in eng.runner.graphs.graphs} >= {8}  # 5 sequences padded to 8
    assert len({t for seq in ref for t in seq}) > 5  # non-trivial output
    assert got == ref
