"""CPU throughput: omnistage's Qwen2.5-Omni pipeline vs transformers' `generate` (tiny checkpoint).

Same process, same chat prompts, greedy decoding, fixed output lengths on both sides:
  --mode text    16 prompts mixing text, audio and image -> text only (the thinker stage)
  --mode speech  16 text prompts -> text + audio (thinker -> talker -> code2wav)
Systems:
  omnistage   one `OmniLLM.generate` call with every prompt
  hf_single   `Qwen2_5OmniForConditionalGeneration.generate` one prompt at a time
  hf_batch    the same on left-padded batches of `--hf-batch` prompts (0 = skip; an error is
              recorded in the JSON instead of timings)
Both sides' timings include prompt processing (chat template, audio features, image patches).

Usage: python benchmarks/cpu_omni.py --mode {text,speech} [--prompts 16] [--thinker-tokens N]
         [--talker-codes N] [--hf-batch N] [--threads N] [--repeats 3] [--out FILE]
Prints one JSON object to stdout (and writes it to --out)."""

from __future__ import annotations

import argparse
import codecs
import contextlib
import datetime
import io
import os
import platform
import tempfile
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402


SAMPLE_RATE = 24000
CODE2WAV_SEED = 7
CONTENDED = 0.25  # others' CPU seconds per wall second above which a run counts as contended


# ---------------------------------------------------------------- timing
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError as e:
        return f"unknown ({e})"
    return platform.processor() or "unknown"


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (all processes), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class Stopwatch:
    """Wall seconds of a block, our CPU seconds, and other processes' CPU seconds (contention)."""

    def __enter__(self) -> Stopwatch:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.machine = machine_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu
        self.others = max(0.0, machine_cpu_seconds() - self.machine - self.cpu)


@dataclass
class Timed:
    best: Stopwatch
    output: object
    tries: int


def contended(w: Stopwatch) -> bool:
    return w.others / w.wall >= CONTENDED


def best_of(fn: Callable[[], object], repeats: int) -> Stopwatch:
    """Fastest uncontended of `repeats` runs of fn (or the fastest, if all were contended)."""
    runs = []
    for _ in range(repeats):
        with Stopwatch() as watch:
            fn()
        runs.append(watch)
    return min([r for r in runs if not contended(r)] or runs, key=lambda r: r.wall)


def measure(systems: dict[str, list[Callable[[], object]]], repeats: int, extra: int
            ) -> dict[str, list[Timed]]:
    """Time every unit of every system `repeats` times, interleaved round by round (so all
    systems see the machine's load alike), then up to `extra` more rounds of the units whose
    runs were all contended. A unit's fastest uncontended run counts; its first output is kept.

    NOTE: other processes on a small machine slow OpenMP threads unevenly; timing the systems
    one after another would hand whichever ran in a quiet minute the win."""
    runs = {k: [[] for _ in fns] for k, fns in systems.items()}
    firsts: dict[str, list[object]] = {k: [None] * len(fns) for k, fns in systems.items()}

    def once(k: str, i: int) -> None:
        with Stopwatch() as watch:
            out = systems[k][i]()
        if not runs[k][i]:
            firsts[k][i] = out
        runs[k][i].append(watch)

    for _ in range(repeats):
        for k, fns in systems.items():
            for i in range(len(fns)):
                once(k, i)
    for _ in range(extra):
        todo = [(k, i) for k, rs in runs.items() for i, r in enumerate(rs)
                if all(contended(w) for w in r)]
        for k, i in todo:
            once(k, i)
    return {k: [Timed(min([w for w in r if not contended(w)] or r, key=lambda w: w.wall),
                      firsts[k][i], len(r)) for i, r in enumerate(rs)]
            for k, rs in runs.items()}


@dataclass
class Result:
    """What one request produced (for rates and the agreement check)."""

    text_ids: list[int]
    codes: list[int] | None = None
    audio: np.ndarray | None = None


def summarize(units: list[Timed], results: list[Result]) -> dict:
    wall = sum(u.best.wall for u in units)
    n_text = sum(len(r.text_ids) for r in results)
    out = {"seconds": round(wall, 4), "requests": len(results),
           "requests_per_s": round(len(results) / wall, 3),
           "thinker_tokens": n_text, "thinker_tokens_per_s": round(n_text / wall, 1)}
    if results and results[0].codes is not None:
        n_codes = sum(len(r.codes) for r in results)
        audio_s = sum(len(r.audio) for r in results) / SAMPLE_RATE
        out.update(talker_codes=n_codes, talker_codes_per_s=round(n_codes / wall, 1),
                   audio_seconds=round(audio_s, 3),
                   audio_seconds_per_s=round(audio_s / wall, 3))
    out.update(timed_units=len(units), runs=sum(u.tries for u in units),
               contended_units=sum(contended(u.best) for u in units),
               cpu_per_wall=round(sum(u.best.cpu for u in units) / wall, 2),
               others_cpu_per_wall=round(sum(u.best.others for u in units) / wall, 2))
    return out


# ---------------------------------------------------------------- prompts
def make_prompts(mode: str, n: int, offset: int = 0) -> list[list[dict]]:
    """Chat messages. text: the tiny test cases (text / audio / image mixes) cycled, with
    different media per round; speech: one user line each, from the Zen of Python."""
    from omnistage.testing.tiny_omni import tiny_omni_test_messages

    if mode == "text":
        cases = list(tiny_omni_test_messages())
        return [tiny_omni_test_messages(seed=offset + i // len(cases))[cases[i % len(cases)]]
                for i in range(n)]
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    lines = [s for s in codecs.decode(this.s, "rot13").splitlines()[2:] if s.strip()]
    return [[{"role": "user", "content": f"{lines[(offset + i) % len(lines)]} Say it aloud."}]
            for i in range(n)]


# ---------------------------------------------------------------- omnistage
def omni_params(args: argparse.Namespace) -> dict:
    from omnistage import SamplingParams
    from omnistage.testing.tiny_omni import TINY_TALKER_EOS

    T, C = args.thinker_tokens, args.talker_codes
    return {"thinker": SamplingParams(temperature=0, max_tokens=T, min_tokens=T,
                                      ignore_eos=args.ignore_eos),
            "talker": SamplingParams(temperature=0, repetition_penalty=1.05, max_tokens=C,
                                     min_tokens=C, stop_token_ids=TINY_TALKER_EOS,
                                     suppress_token_ids=[121]),
            "code2wav": SamplingParams(seed=CODE2WAV_SEED)}


def code2wav_batch_sizes(pipeline) -> list[int]:
    """Utterances per code2wav batch so far ([] where the pipeline does not count them)."""
    stage = getattr(pipeline, "code2wav", None)
    return list(getattr(stage, "batch_sizes", None)
                or getattr(pipeline, "code2wav_batch_sizes", None) or [])


class OmniRunner:
    """omnistage's side: one `generate` call with every prompt is one unit of work."""

    def __init__(self, path: Path, args, prompts, warmup) -> None:
        from omnistage import OmniLLM

        self.llm = OmniLLM(str(path), device="cpu", dtype="float32",
                           talker_handoff=args.talker_handoff,
                           enable_prefix_caching=args.prefix_caching)
        self.args, self.prompts, self.params = args, prompts, omni_params(args)
        self.modalities = ["text"] if args.mode == "text" else None
        self.generate(warmup)
        pipe = self.llm.pipeline
        self.steps0 = {name: e.num_steps for name, e in pipe.engines.items()}
        self.c2w0 = len(code2wav_batch_sizes(pipe))

    def generate(self, prompts) -> list[Result]:
        outs = self.llm.generate([{"messages": m} for m in prompts], self.params,
                                 output_modalities=self.modalities, use_tqdm=False)
        bad = [o.error for o in outs if o.error]
        if bad:
            raise RuntimeError(f"omnistage request failed: {bad[0]}")
        return [Result(o.token_ids, o.stages["talker"].token_ids if o.audio is not None else None,
                       o.audio) for o in outs]

    def stats(self, timed: Timed) -> dict:
        pipe, res = self.llm.pipeline, summarize([timed], timed.output)
        for name, e in pipe.engines.items():
            res[f"{name}_engine_steps_per_run"] = (e.num_steps - self.steps0[name]) // timed.tries
        if self.args.mode == "speech":  # utterances per code2wav batch, over every timed run
            res["code2wav_batch_sizes_all_runs"] = code2wav_batch_sizes(pipe)[self.c2w0:]
        speech = self.args.mode == "speech"  # prompt processing alone (part of the timed call)
        res["prompt_processing_seconds"] = round(best_of(lambda: [
            pipe.processor.process(m, add_audio_system_prompt=speech) for m in self.prompts],
            self.args.repeats).wall, 4)
        return res


# ---------------------------------------------------------------- transformers
class HFRunner:
    """transformers' Qwen2.5-Omni generate, with the talker's codes captured (the waveform
    alone does not show them)."""

    def __init__(self, path: Path, args) -> None:
        from transformers import Qwen2_5OmniForConditionalGeneration

        from omnistage.testing.tiny_omni import build_tiny_omni_processor

        self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(
            str(path), dtype=torch.float32).eval()
        self.proc = build_tiny_omni_processor(path)
        self.proc.tokenizer.padding_side = "left"
        self.args = args
        self.codes: list[torch.Tensor] = []
        forward = self.model.token2wav.forward

        def capture(code, **kw):
            self.codes.append(code[0].clone())
            return forward(code, **kw)
        self.model.token2wav.forward = capture

    def inputs(self, batch: list[list[dict]]) -> dict:
        if self.args.mode == "speech":  # audio out: Qwen's system prompt, as omnistage adds it
            from omnistage.models.qwen2_5_omni.processor import QWEN_AUDIO_SYSTEM_PROMPT
            sysmsg = {"role": "system", "content": QWEN_AUDIO_SYSTEM_PROMPT}
            batch = [m if m[0]["role"] == "system" else [sysmsg] + m for m in batch]
        inputs = self.proc.apply_chat_template(
            batch if len(batch) > 1 else batch[0], add_generation_prompt=True, tokenize=True,
            return_dict=True, return_tensors="pt", padding=len(batch) > 1)
        if "pixel_values" in inputs:  # un-prefixed kwargs also reach the talker
            inputs["thinker_pixel_values"] = inputs.pop("pixel_values")
        return inputs

    def generate(self, batch: list[list[dict]]) -> list[Result]:
        """Prompt processing + generate for one batch -> one Result per prompt."""
        from omnistage.testing.tiny_omni import TINY_TALKER_EOS

        a = self.args
        inputs = self.inputs(batch)
        P = inputs["input_ids"].shape[1]
        T, C = a.thinker_tokens, a.talker_codes
        kw = dict(thinker_do_sample=False, thinker_max_new_tokens=T, thinker_min_new_tokens=T)
        with torch.inference_mode():
            if a.mode == "text":
                seq = self.model.generate(**inputs, generation_mode="text", **kw)
                return [Result(row[P:].tolist()) for row in seq]
            self.codes.clear()
            torch.manual_seed(CODE2WAV_SEED)  # code2wav's noise, as omnistage seeds it
            seq, wav = self.model.generate(
                **inputs, speaker="Chelsie", talker_do_sample=False, talker_max_new_tokens=C,
                talker_min_new_tokens=C, talker_eos_token_id=TINY_TALKER_EOS, **kw)
        wavs = [wav] if len(batch) == 1 else wav
        return [Result(row[P:].tolist(), c.tolist(), w.reshape(-1).float().numpy())
                for row, c, w in zip(seq, self.codes, wavs)]


def hf_stats(hf: HFRunner, units: list[Timed], prompts, repeats: int) -> tuple[dict, list]:
    results = [r for u in units for r in u.output]
    res = summarize(units, results)
    # prompt processing alone (part of the timed units): processor + chat template
    res["prompt_processing_seconds"] = round(best_of(
        lambda: [hf.inputs([m]) for m in prompts], repeats).wall, 4)
    return res, results


def agreement(a: list[Result], b: list[Result]) -> dict:
    """Lengths equal on both sides, identical greedy outputs, waveform max abs diff."""
    def same_len(x: Result, y: Result) -> bool:
        ok = len(x.text_ids) == len(y.text_ids)
        if x.codes is not None:
            ok &= len(x.codes) == len(y.codes) and len(x.audio) == len(y.audio)
        return ok

    out = {"compared": len(a), "lengths_equal": sum(same_len(x, y) for x, y in zip(a, b)),
           "thinker_identical": sum(x.text_ids == y.text_ids for x, y in zip(a, b))}
    if a and a[0].codes is not None:
        same = [(x, y) for x, y in zip(a, b) if x.codes == y.codes]
        out["talker_codes_identical"] = len(same)
        diffs = [float(np.abs(x.audio - y.audio).max()) for x, y in same
                 if len(x.audio) == len(y.audio)]
        if diffs:
            out["audio_max_abs_diff_where_codes_identical"] = float(f"{max(diffs):.3g}")
    return out


# ---------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["text", "speech"], required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--thinker-tokens", type=int, default=None,
                    help="new text tokens per request (default: text 64, speech 32)")
    ap.add_argument("--talker-codes", type=int, default=128, help="codec codes per request")
    ap.add_argument("--hf-batch", type=int, default=None,
                    help="HF padded batch size, 0 = skip")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="omnistage thinker: ignore_eos=True (eos may be sampled) instead of "
                         "transformers' min_new_tokens semantics (eos masked until the length)")
    ap.add_argument("--talker-handoff", choices=["qwen", "transformers5"],
                    default="transformers5",
                    help="omnistage talker handoff; transformers5 makes codes comparable "
                         "to transformers 5 one at a time (same cost either way)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="enable omnistage's prefix cache (off: repeats and HF get no reuse)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs of each unit; the fastest uncontended one counts")
    ap.add_argument("--extra-runs", type=int, default=3,
                    help="more rounds for units whose runs were all contended")
    ap.add_argument("--model-dir", type=str, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", type=str, default=None)
    args = ap.parse_args()
    args.thinker_tokens = args.thinker_tokens or (64 if args.mode == "text" else 32)
    if args.hf_batch is None:
        args.hf_batch = 16
    for name in ("prompts", "thinker_tokens", "talker_codes", "threads", "repeats"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be positive")
    if args.hf_batch < 0 or args.extra_runs < 0:
        raise ValueError("--hf-batch, --extra-runs: must be >= 0")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()  # per-call processor/generation-flag notices
    from omnistage.testing.tiny_omni import build_tiny_omni

    tmp = None if args.model_dir else tempfile.TemporaryDirectory()
    path = build_tiny_omni(Path(args.model_dir or tmp.name) / "tiny-omni-bench", seed=0)
    prompts = make_prompts(args.mode, args.prompts)
    warmup = make_prompts(args.mode, 6 if args.mode == "text" else 2, offset=50)
    load_before = os.getloadavg()

    omni_runner = OmniRunner(path, args, prompts, warmup)
    systems: dict[str, list[Callable[[], object]]] = {
        "omnistage": [lambda: omni_runner.generate(prompts)]}
    hf, batch_error = None, None
    key = f"hf_padded_batch_{args.hf_batch}"
    if not args.skip_hf:
        hf = HFRunner(path, args)
        for m in warmup[:2]:
            hf.generate([m])
        systems["hf_one_at_a_time"] = [lambda m=m: hf.generate([m]) for m in prompts]
        if args.hf_batch:
            try:  # whether transformers' Omni generate batches at all is part of the result
                hf.generate(warmup[:args.hf_batch])
            except Exception as e:  # noqa: BLE001 (recorded in the JSON)
                batch_error = f"{type(e).__name__}: {e}"
            else:
                systems[key] = [lambda i=i: hf.generate(prompts[i:i + args.hf_batch])
                                for i in range(0, len(prompts), args.hf_batch)]
    timed = measure(systems, args.repeats, args.extra_runs)
    omni, omni_res = omni_runner.stats(timed["omnistage"][0]), timed["omnistage"][0].output
    speech = args.mode == "speech"
    result: dict = {
        "benchmark": f"cpu_omni_{args.mode}",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": {
            "model": "tiny random Qwen2.5-Omni (omnistage.testing.tiny_omni, seed 0)",
            "mode": args.mode, "dtype": "float32", "prompts": args.prompts,
            "prompt_kinds": ("tiny_omni_test_messages cases cycled (text_only, audio_text, "
                             "image_text, audio_image_text, multi_turn, two_images), media "
                             "from seeds 0..2" if not speech else
                             "one text user turn each; Qwen's audio system prompt"),
            "prompt_tokens_total": None,
            "thinker_tokens_per_request": args.thinker_tokens,
            "talker_codes_per_request": args.talker_codes if speech else None,
            "audio_seconds_per_request": args.talker_codes * 480 / SAMPLE_RATE if speech else None,
            "decoding": "greedy (talker repetition_penalty 1.05, codec bos suppressed)",
            "omnistage_length_control": (
                "thinker min_tokens=max_tokens" + (", ignore_eos=True" if args.ignore_eos else
                                                    " (eos masked, like HF)")
                + ("; talker min_tokens=max_tokens, stop_token_ids=TINY_TALKER_EOS" if speech
                   else "")),
            "hf_length_control": ("thinker_min_new_tokens=thinker_max_new_tokens"
                                  + ("; talker_min_new_tokens=talker_max_new_tokens (honoured)"
                                     if speech else "")),
            "omnistage_talker_handoff": args.talker_handoff if speech else None,
            "omnistage_prefix_caching": args.prefix_caching,
            "includes_prompt_processing": True,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "python": platform.python_version(), "cpu": cpu_model(),
            "cpu_count": os.cpu_count(), "repeats": args.repeats,
            "timing": ("after a warm-up, each unit (the omnistage call, each HF prompt, each HF "
                       "batch) runs `repeats` times, the systems interleaved round by round, "
                       "plus up to `extra_runs` rounds of units whose runs were all contended; "
                       "a unit's fastest uncontended run counts; seconds = sum over units"),
            "extra_runs": args.extra_runs,
            "contended_means": f"other processes used >= {CONTENDED} CPU-s per wall-s",
        },
        "omnistage": omni,
    }
    if hf is not None:
        result["config"]["prompt_tokens_total"] = sum(
            hf.inputs([m])["input_ids"].shape[1] for m in prompts)
        single, single_res = hf_stats(hf, timed["hf_one_at_a_time"], prompts, args.repeats)
        result["hf_one_at_a_time"] = single
        result["speedup"] = {"omnistage_vs_hf_one_at_a_time":
                             round(single["seconds"] / omni["seconds"], 2)}
        result["agreement_omnistage_vs_hf_one_at_a_time"] = agreement(omni_res, single_res)
        if batch_error:
            result[key] = {"error": batch_error}
        elif key in timed:
            units = timed[key]
            batch_res = [r for u in units for r in u.output]
            result[key] = {**summarize(units, batch_res), "batch_size": args.hf_batch}
            result["speedup"][f"omnistage_vs_{key}"] = round(
                result[key]["seconds"] / omni["seconds"], 2)
            result[f"agreement_{key}_vs_hf_one_at_a_time"] = agreement(batch_res, single_res)
        result["any_contended_units"] = any(
            r.get("contended_units", 0) for r in result.values() if isinstance(r, dict))
    write_result(result, args.out, load_before)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
