"""HF checkpoint folders: resolve (local path or hub id), read configs, stream safetensors, and
copy named tensors into a module's parameters (`load_parameters`)."""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from omnistage.config import env
from omnistage.layers.parallel import current_tp
from omnistage.weights_upload import DeviceUploads


def resolve_model_path(model: str) -> Path:
    """A local directory, or a hub id downloaded with huggingface_hub (clear error offline)."""
    if not isinstance(model, str) or not model:
        raise ValueError("model: must be a non-empty path or hub id")
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "model_index.json").is_file():
            raise ValueError(f"model: {model!r} has no config.json (nor a diffusers "
                             "model_index.json)")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(f"model: {model!r} is not a checkpoint directory "
                         "(and not a hub id of the form 'org/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    try:
        local = snapshot_download(model, allow_patterns=[
            "*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "spk_dict.pt"])
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ValueError(f"model: cannot download {model!r} from the hub "
                         f"({type(e).__name__}: {e}); pass a local checkpoint directory") from e
    return Path(local)


def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def load_config(path: Path) -> dict:
    """config.json; for a diffusers pipeline folder, its model_index.json (`_class_name` names
    the pipeline)."""
    if not (path / "config.json").is_file() and (path / "model_index.json").is_file():
        return read_json(path / "model_index.json")
    return read_json(path / "config.json")


def load_generation_config(path: Path) -> dict:
    p = path / "generation_config.json"
    return read_json(p) if p.is_file() else {}


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index)["weight_map"].values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise ValueError(f"model: shards listed in the index are missing: {missing}")
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ValueError(f"model: no .safetensors weights in {path}")
    return found


class LazyTensor:
    """A checkpoint tensor not read yet (tensor-parallel loading): its shape and dtype, and
    reads of a slice along one dim (only those bytes of the safetensors mmap) or of the whole.
    Valid while iter_tensors' generator is at it (the file stays open until it moves on)."""

    def __init__(self, file_slice) -> None:
        self._slice = file_slice
        self.shape = torch.Size(file_slice.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(file_slice.get_dtype())
        if self.dtype is None:
            raise ValueError(f"checkpoint dtype {file_slice.get_dtype()!r} is not supported")

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def full(self) -> torch.Tensor:
        return self._slice[...]


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


def as_tensor(tensor) -> torch.Tensor:
    """A torch.Tensor of a checkpoint tensor (reads a LazyTensor whole)."""
    return tensor.full() if isinstance(tensor, LazyTensor) else tensor


def iter_tensors(path: Path, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor whose name starts with `prefix` (prefix stripped).
    Inside layers.parallel.tensor_parallel (size > 1) the tensors are LazyTensors: each rank
    reads only the slices its parameters hold (load_parameters)."""
    lazy = current_tp().enabled
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    value = LazyTensor(f.get_slice(name)) if lazy else f.get_tensor(name)
                    yield name[len(prefix):], value


def dummy_tensors(model: torch.nn.Module, seed: int = 0,
                  std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
    """load_format="dummy": a random tensor for every parameter of `model`, by its own name,
    on its device and dtype: norm weights 1, other 1-D parameters 0, matrices N(0, std).
    Each is a pure function of (seed, name), so any model holding the same names (e.g.
    transformers' under a stage prefix) can be given the very same weights; a tensor-parallel
    shard gets the whole tensor (its `tp_shard`'s shape), of which it keeps its slice."""
    for name, p in model.named_parameters():
        shard = getattr(p, "tp_shard", None)
        shape = shard.full_shape if shard is not None else p.shape
        if p.dim() == 1:
            value = torch.ones(shape) if "norm" in name else torch.zeros(shape)
            yield name, value.to(p.device, p.dtype)
            continue
        g = torch.Generator(device=p.device).manual_seed(
            (seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFFFFFFFFFF)
        yield name, torch.randn(shape, generator=g, device=p.device,
                                dtype=torch.float32).mul_(std).to(p.dtype)


# buffers a module computes from its config, which some checkpoints carry as tensors
DERIVED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


def load_parameters(module: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], *,
                    rename: Callable[[str], str | None] | None = None,
                    load_special: Callable[[str, torch.Tensor], set[str] | None] | None = None,
                    shown_prefix: str = "") -> None:
    """Copy checkpoint tensors into `module`'s parameters by name.

    rename(name): our parameter name for a checkpoint name, or None when the tensor is not
    ours (skipped); default: the name itself. Tensors named `*rotary_emb.inv_freq` (derived
    from the config) are skipped too.
    load_special(ours, tensor): None for a plain parameter; otherwise it copied the tensor
    itself and returns the parameter names that are now fully loaded (e.g. an MoE's fused
    expert weights once every expert's matrices came).
    A parameter with a `tp_shard` (layers/parallel.py: a tensor-parallel shard) gets its slice
    of the whole tensor; tensors may be LazyTensors (only what is kept is read).
    ValueError naming the tensor (`shown_prefix` + its checkpoint name) for a name with no
    parameter or a wrong shape, and naming the parameters no tensor filled."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    uploads = DeviceUploads()  # large copies to a GPU, landed before this returns
    try:
        for name, tensor in tensors:
            ours = name if rename is None else rename(name)
            if ours is None or ours.endswith(DERIVED_TENSOR_SUFFIXES):
                continue
            done = None if load_special is None else load_special(ours, tensor)  # may be lazy
            if done is not None:
                loaded |= done
                continue
            shown = f"{shown_prefix}{name}"
            if ours not in params:
                raise ValueError(f"checkpoint tensor {shown!r} has no matching parameter "
                                 f"({type(module).__name__} has no such parameter {ours!r})")
            p = params[ours]
            shard = getattr(p, "tp_shard", None)
            if shard is not None:
                try:
                    tensor = shard.take(tensor)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {shown!r}: {e}") from e
            tensor = as_tensor(tensor)
            if p.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {shown!r}: shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(p.shape)}")
            if uploads.takes(p, tensor):
                uploads.copy(p.data, tensor)
            else:
                with torch.no_grad():
                    p.copy_(tensor)
            loaded.add(ours)
    finally:
        uploads.finish()
    missing = sorted(f"{shown_prefix}{n}" for n in set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")


def load_tokenizer(path: Path):
    # AutoTokenizer's choice, without its heavy import where the checkpoint settles it
    from omnistage.tokenizer_loader import load_tokenizer as load_known_or_auto
    env.quiet_tokenizer_threads()
    return load_known_or_auto(path)


def eos_token_ids(generation_config: dict, config: dict, tokenizer) -> set[int]:
    """Stop set: generation_config eos ∪ tokenizer eos (∪ config eos when no generation_config)."""
    ids: set[int] = set()
    for src in (generation_config.get("eos_token_id"),
                None if generation_config else config.get("eos_token_id")):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(int(i) for i in src)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars off inside, back as they were after. Its config
    validation warns about every Qwen2.5-Omni checkpoint (the talker config holds thinker token
    ids beyond the talker's vocab), on each load through AutoConfig: noise, not a problem."""
    from transformers.utils import logging as hf_logging
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
