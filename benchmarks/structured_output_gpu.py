"""Decode ms/step with and without a JSON-schema bitmask (SamplingParams.structured_output), on
a random-weight LM of Qwen2.5-7B shapes (28 layers, d 3584, 28 heads, 4 KV heads, vocab
152064, bf16, CUDA graphs), at batch 1 and 32 (--batches).

Per batch size, two cases on the same engine: `free` (greedy, no grammar) and `json` (greedy,
every row following a JSON schema of many required string fields, so no row ends while
timed). Per
case: step_ms (engine.step wall clock, each step's tokens read back; the default async
scheduling is on: a step launched ahead with grammar rows queues its forward at once and its
sampler once the last tokens are accepted), step_ms_sync (async scheduling off for both),
host_mask_fill_ms (the matchers' bitmask fill and its copy, per step) and, for json,
overhead_pct against free. The grammar's vocabulary is synthetic (the 256 bytes + random
printable words up to the 151643 ids of Qwen2.5's tokenizer; the rest of the 152064 rows are
padding, masked), so the host-side mask cost is that of a vocabulary of the real size.

    PYTHONPATH=$PWD python benchmarks/structured_output_gpu.py --out $OUT/so.json
`--device cpu --tiny` runs the same code on a tiny model (a smoke test, not a measurement).
Prints (and with --out writes) one JSON object; a failing case records its error.
"""

from __future__ import annotations

import argparse
import gc
import importlib.machinery
import json
import random
import sys
import time
import traceback
import types
from pathlib import Path

import torch

try:
    import soundfile  # noqa: F401
except ImportError:  # the GPU machine lacks it; nothing here reads audio files
    sys.modules["soundfile"] = types.ModuleType("soundfile")
    sys.modules["soundfile"].__spec__ = importlib.machinery.ModuleSpec("soundfile", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from omnistage.engine.ar.engine import AREngine  # noqa: E402
from omnistage.engine.ar.scheduler import EngineConfig  # noqa: E402
from omnistage.engine.ar.sequence import Sequence  # noqa: E402
from omnistage.engine.ar.structured_output import GrammarCache  # noqa: E402
from omnistage.models.layers import DecoderForCausalLM  # noqa: E402
from omnistage.sampling_params import SamplingParams, StructuredOutput  # noqa: E402

QWEN2_5_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                  num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                  rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=False)
TINY = dict(QWEN2_5_7B, vocab_size=4096, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TOKENIZER_IDS = {152064: 151643, 4096: 4000}  # ids with text (the rest: padding rows)
PROMPT_LEN = 60
WARM = 4  # tokens per sequence before timing (prefill, graph captures)


def schema(fields: int) -> dict:
    """An object of `fields` required string fields, in order: no row can end before it has
    written every key (greedy on random weights closes a string at random), and its grammar
    is an ordinary JSON schema's (a minLength string instead costs xgrammar ~1 ms an accepted
    token, a cost of that schema, not of the bitmask path)."""
    names = [f"field_{i}" for i in range(fields)]
    return {"type": "object", "properties": {name: {"type": "string"} for name in names},
            "required": names, "additionalProperties": False}


def synthetic_vocab(n: int, seed: int = 0) -> list[str]:
    """n token strings: the 256 bytes, random printable words (a third with a leading space),
    and an end-of-text token last."""
    rng = random.Random(seed)
    chars = [chr(c) for c in range(32, 127)]
    vocab = [bytes([b]).decode("latin-1") for b in range(256)]
    seen = set(vocab)
    while len(vocab) < n - 1:
        word = "".join(rng.choice(chars) for _ in range(rng.randint(2, 8)))
        word = " " + word if rng.random() < 0.3 else word
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    return vocab + ["<|endoftext|>"]


def build_model(cfg: dict, dev: torch.device, dtype: torch.dtype) -> DecoderForCausalLM:
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random init straight in the target dtype
    try:
        with torch.device(dev):
            return DecoderForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def seqs(B: int, tag: str, spec: StructuredOutput | None, vocab: int) -> list[Sequence]:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(300, vocab - 200, (PROMPT_LEN,), generator=g).tolist()
    p = SamplingParams(temperature=0.0, max_tokens=100000, structured_output=spec)
    return [Sequence(f"{tag}-{i}", list(prompt), p, seed=i) for i in range(B)]


def measure(engine: AREngine, batch: list[Sequence], steps: int, dev) -> dict:
    for s in batch:
        engine.add_request(s)
    while min(len(s.output_token_ids) for s in batch) < WARM:
        engine.step()
    state = engine.runner.sampler
    fill: list[float] = []
    real_flush = state.flush_grammar

    def timed_flush() -> None:  # host time of the matchers' bitmask fill (and its copy)
        t0 = time.perf_counter()
        real_flush()
        fill.append(time.perf_counter() - t0)

    state.flush_grammar = timed_flush
    res: dict = {}
    try:
        for key, ahead in (("step_ms", True), ("step_ms_sync", False)):
            engine.async_scheduling = ahead
            fill.clear()
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync(dev)
            res[key] = round(1e3 * (time.perf_counter() - t0) / steps, 3)
            if not ahead:  # (per step; steps without a grammar call it as a no-op)
                res["host_mask_fill_ms"] = round(1e3 * sum(fill) / max(1, len(fill)), 3)
    finally:
        state.flush_grammar = real_flush
        engine.async_scheduling = True
    alive = [s for s in batch if engine.seqs.get(s.request_id) is s]
    res["rows_alive"] = len(alive)  # all of them: no row ended inside the timing
    res["text_head"] = batch[0].output_token_ids[:8]
    for s in batch:
        engine.abort(s.request_id)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = TINY if args.tiny else QWEN2_5_7B
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    batches = [int(b) for b in args.batches.split(",")]
    steps = min(args.steps, 20) if args.tiny else args.steps
    res: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "model": "tiny" if args.tiny else "Qwen2.5-7B shapes, random bf16",
                 "steps": steps, "batches": batches}
    import xgrammar
    V = cfg["vocab_size"]
    model = build_model(cfg, dev, dtype)
    engine = AREngine(model, EngineConfig(max_model_len=4096, max_num_seqs=max(batches),
                                          max_num_batched_tokens=4096),
                      dev, dtype, tokenizer=None, eos_token_ids={TOKENIZER_IDS[V] - 1})
    t0 = time.perf_counter()
    vocab = synthetic_vocab(TOKENIZER_IDS[V])
    info = xgrammar.TokenizerInfo(vocab, vocab_type=xgrammar.VocabType.RAW, vocab_size=V,
                                  stop_token_ids=[len(vocab) - 1])
    engine._grammars = GrammarCache(None, V, tokenizer_info=info)
    spec = StructuredOutput(json_schema=schema(2 * steps + 50))
    engine._grammars.compile(spec)
    res["grammar_compile_s"] = round(time.perf_counter() - t0, 2)
    for B in batches:
        for name, case_spec in (("free", None), ("json", spec)):
            key = f"b{B}_{name}"
            try:
                res[key] = measure(engine, seqs(B, key, case_spec, len(vocab)), steps, dev)
            except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
                res[key] = {"error": f"{type(e).__name__}: {e}"}
                traceback.print_exc(file=sys.stderr)
        free, js = res.get(f"b{B}_free", {}), res.get(f"b{B}_json", {})
        for k in ("step_ms", "step_ms_sync"):
            if k in free and k in js:
                js[f"overhead_pct_{k}"] = round(100 * (js[k] / free[k] - 1), 2)
    text = json.dumps(res, indent=1)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    del engine  # (its matchers before xgrammar's module state, at interpreter exit)
    gc.collect()


if __name__ == "__main__":
    main()
