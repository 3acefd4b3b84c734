"""Weight-only FP8 dense decoders (models/fp8_decoder.py): the Triton GEMVs with row scales
(CPU via TRITON_INTERPRET=1) against torch on the dequantised weights; a quantised LM and the
Qwen2.5-Omni thinker against transformers running the same dequantised weights (the reference
nobody here wrote); FP8's accuracy against 16-bit on real weights (SmolLM2-135M)."""

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from omnistage import OmniLLM, SamplingParams  # noqa: E402
from omnistage.layers.fp8 import Fp8Linear, dequantize_fp8, quantize_fp8  # noqa: E402
from omnistage.models.layers import DecoderLayer, _rms_norm  # noqa: E402
from tests.engine.hf_reference import assert_greedy_match, hf_greedy  # noqa: E402

EPS = 1e-6


@torch.no_grad()
def fake_quantize(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Every nn.Linear weight of a transformers model -> dequantize(quantize_fp8(w)) in place
    (what the FP8 engine computes with). Returns the number of weights replaced."""
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not any(s in name for s in skip):
            w8, scale = quantize_fp8(mod.weight)
            mod.weight.copy_(dequantize_fp8(w8, scale, mod.weight.dtype))
            n += 1
    return n


@pytest.mark.parametrize("M", [1, 3])
def test_fp8_gemvs_equal_torch_on_dequantized_weights(M):
    tg = pytest.importorskip("omnistage.engine.ar.triton_gemv")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(M)
    N, K = 70, 150  # not multiples of the blocks
    x = (torch.randn(M, K, generator=g) * 2 + 0.5).to(dev)
    ln_w = (1 + torch.randn(K, generator=g) / 4).to(dev)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dev)
    b = torch.randn(N, generator=g).to(dev)
    r = (torch.randn(M, N // 2, generator=g) * 2).to(dev)
    w8, s = quantize_fp8(w)
    wd = dequantize_fp8(w8, s, torch.float32)
    assert (wd - w).abs().max() > 0  # the quantisation is not a no-op ...
    assert (wd - w).abs().max() <= w.abs().max() / 16  # ... and within e4m3's 3 mantissa bits
    half, s_half = w8[:N // 2], s[:N // 2]
    got = [tg.norm_gemv(x, ln_w, EPS, w8, b, scale=s),
           tg.norm_gemv_silu_mul(x, ln_w, EPS, w8, b, scale=s),
           tg.gemv_residual(x, half, r, b[:N // 2], scale=s_half)]
    h = F.linear(_rms_norm(x, ln_w, EPS), wd, b)
    gate, up = h.chunk(2, dim=-1)
    want = [h, F.silu(gate) * up, r + F.linear(x, wd[:N // 2], b[:N // 2])]
    for out, ref in zip(got, want):
        assert ref.abs().mean() > 0.1
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    with pytest.raises(ValueError, match="scale"):
        tg.norm_gemv(x, ln_w, EPS, w8, b, scale=s[:-1])


def test_quantized_lm_equals_transformers_on_dequantized_weights(tiny_qwen2):
    from transformers import AutoModelForCausalLM
    llm = OmniLLM(str(tiny_qwen2), device="cpu", quantization="fp8")
    layers = [m for m in llm.pipeline.model.modules() if isinstance(m, DecoderLayer)]
    assert layers and all(layer.fp8 is not None for layer in layers)
    assert all(layer.fp8.w_qkv.dtype == torch.float8_e4m3fn for layer in layers)
    assert not any(hasattr(layer.self_attn, "q_proj") for layer in layers)  # 16-bit ones freed
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    tied = hf.config.tie_word_embeddings
    assert fake_quantize(hf, skip=("lm_head",) if tied else ()) > 0
    assert isinstance(llm.pipeline.model.lm_head, Fp8Linear) != tied
    prompts = [[1, 5, 9, 33, 70], [2, 44, 8]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref, scores = hf_greedy(hf, p, 12)
        assert len(set(ref)) > 2  # a non-degenerate continuation
        assert_greedy_match(out.token_ids, ref, scores, f"fp8 prompt {i}")


def test_quantized_omni_thinker_equals_transformers(tiny_omni_dir):
    """quantization="fp8" on Qwen2.5-Omni quantises the thinker's LM only (its encoders and the
    talker stay as they were); greedy text equals transformers' thinker on the dequantised
    weights, and the pipeline still speaks."""
    from transformers import Qwen2_5OmniForConditionalGeneration
    llm = OmniLLM(str(tiny_omni_dir), device="cpu", quantization="fp8")
    thinker = llm.pipeline.thinker
    assert all(layer.fp8 is not None for layer in thinker.model.layers)
    talker_layers = [m for m in llm.pipeline.workers["talker"].engine.runner.model.modules()
                     if isinstance(m, DecoderLayer)]
    assert talker_layers and all(layer.fp8 is None for layer in talker_layers)
    hf = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_omni_dir,
                                                             dtype=torch.float32).eval()
    n = fake_quantize(hf.thinker.model.language_model)
    if not hf.thinker.config.get_text_config().tie_word_embeddings:
        n += fake_quantize(hf.thinker, skip=("model.",))  # its lm_head
    assert n > 0
    prompt = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
    vocab = thinker.config.vocab_size
    prompt = [t % vocab for t in prompt]
    out = llm.generate({"prompt_token_ids": prompt},
                       {"thinker": SamplingParams(temperature=0, max_tokens=8, min_tokens=8,
                                                  ignore_eos=True)},
                       output_modalities=["text"], use_tqdm=False)[0]
    ref, scores = hf_greedy(hf.thinker, prompt, 8)
    assert_greedy_match(out.token_ids, ref, scores, "fp8 thinker")
    clip = np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1
    heard = {"role": "user", "content": [{"type": "audio", "audio": clip},
                                         {"type": "text", "text": "hi"}]}
    spoken = llm.generate({"messages": [heard]},  # the encoders' rows meet an FP8 LM
                          {"thinker": SamplingParams(temperature=0, max_tokens=6, seed=0)},
                          use_tqdm=False)[0]
    assert spoken.error is None and spoken.audio is not None and spoken.audio.std() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_fp8_accuracy_on_real_weights(smollm2, dtype):
    """SmolLM2-135M, teacher-forced over a text: FP8 weights (dequantised, transformers) against
    the 16-bit model. The thresholds are loose bounds around what benchmarks/fp8_accuracy.py
    measured, so a broken quantiser (wrong scales, wrong axis) fails."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=dtype).eval()
    quant = AutoModelForCausalLM.from_pretrained(smollm2, dtype=dtype).eval()
    fake_quantize(quant, skip=("lm_head",) if quant.config.tie_word_embeddings else ())
    text = ("The history of the printing press begins in the fifteenth century, when Johannes "
            "Gutenberg combined movable metal type, oil-based ink and a wooden press. Within "
            "fifty years, presses across Europe had printed millions of books, and ideas spread "
            "faster than ever before.")
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        a = base(ids).logits[0].float()
        b = quant(ids).logits[0].float()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = ((a - b).norm() / a.norm()).item()
    assert top1 >= 0.8, top1  # measured 0.84 (bf16) and 0.89 (fp32) on a longer text
    assert 0 < rel < 0.15, rel
