"""The `omnistage` command: generate, demo (serve and bench come with their issues)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from omnistage.sampling_params import SamplingParams


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if present)")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, "
                   "bfloat16, float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _params(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed)


def cmd_generate(args) -> int:
    from omnistage import OmniLLM
    llm = OmniLLM(args.model, device=args.device, dtype=args.dtype,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    prompt = ({"messages": [{"role": "user", "content": args.prompt}]} if args.chat
              else args.prompt)
    out = llm.generate(prompt, _params(args), use_tqdm=False)[0]
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    print(out.text)
    return 0


def cmd_demo(args) -> int:
    from omnistage import OmniLLM
    from omnistage.testing.tiny_lm import build_tiny_lm
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_lm(Path(tmp) / "tiny-qwen2", "qwen2", hidden_size=128, num_layers=2)
        t_build = time.perf_counter() - t0
        llm = OmniLLM(str(path), device=args.device)
        t1 = time.perf_counter()
        outs = llm.generate(["Beautiful is better than", "Simple is better than",
                             {"messages": [{"role": "user", "content": "Say hello."}]}],
                            SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=0),
                            use_tqdm=False)
        t_gen = time.perf_counter() - t1
    for o in outs:
        print(f"[{o.request_id}] {o.text!r}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"built the tiny model in {t_build:.2f} s; generated {n} tokens for {len(outs)} "
          f"requests in {t_gen:.2f} s on {llm.device}")
    print("NOTE: this is a tiny model with random weights, so its text is noise. Point omnistage "
          "at a real checkpoint: `omnistage generate Qwen/Qwen2.5-Omni-7B --prompt ...` or "
          "`omnistage generate /path/to/checkpoint --prompt ...`.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omnistage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="one request from the shell")
    g.add_argument("model", help="checkpoint directory or hub id")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _engine_args(g)
    _sampling_args(g)
    d = sub.add_parser("demo", help="everything on an embedded tiny model, no download")
    d.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    try:
        return {"generate": cmd_generate, "demo": cmd_demo}[args.command](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
