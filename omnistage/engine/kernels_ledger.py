"""Which kernels-ahead jobs have their kernels in the Triton cache already (engine/
kernels_ahead.py): a warm start then spawns no process for them.

A job's kernels are known by the cache keys it returned (Triton's compile hashes). The ledger,
a JSON file in Triton's cache dir, maps a job (its function, arguments, target, Triton version,
ptxas and the source of its module) to those keys; a job counts as done only while every key's
entry is still on disk, so a cleared cache, another Triton or an edited kernel file runs it
again.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import inspect
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnistage.config import env

log = logging.getLogger(__name__)

LEDGER = "omnistage_kernels_ahead.json"


def job_id(compile_fn: Any, args: tuple, target: tuple[str, int, int]) -> str:
    """What a job compiles, as one key (with the ptxas it compiles with: Triton's keys hash
    its version, layers/compile.pin_triton_ptxas)."""
    import triton
    text = repr((compile_fn.__module__, compile_fn.__qualname__, args, target,
                 triton.__version__, _source_hash(inspect.getsourcefile(compile_fn)),
                 env.triton_ptxas_path()))
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=32)
def _source_hash(path: str) -> str:
    # (read once per process: a stage lists many jobs of one kernel file)
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def result_keys(result: Any) -> list[str] | None:
    """A job's result as Triton cache keys (a key, or a list of them); None: not keys."""
    keys = [result] if isinstance(result, str) else result
    if isinstance(keys, (list, tuple)) and keys and all(isinstance(k, str) for k in keys):
        return list(keys)
    return None


def on_disk(cache_dir: Path, key: str) -> bool:
    """Whether Triton's file cache holds the kernel compiled under `key` (its folder is the
    key's base32, and a compiled kernel leaves a group file there)."""
    try:
        name = base64.b32encode(bytes.fromhex(key)).decode().rstrip("=")
    except ValueError:
        return False
    return any((cache_dir / name).glob("__grp__*"))


@dataclass
class KernelLedger:
    path: Path | None  # None: no Triton cache dir (nothing is known, nothing kept)
    entries: dict[str, Any] = field(default_factory=dict)  # job -> its result
    changed: bool = False

    @classmethod
    def load(cls) -> KernelLedger:
        from triton import knobs
        cache_dir = knobs.cache.dir
        if not cache_dir:
            return cls(None)
        path = Path(cache_dir) / LEDGER
        try:
            entries = json.loads(path.read_text())
        except FileNotFoundError:
            entries = {}
        except (OSError, ValueError) as e:  # unreadable: every job runs (and rewrites it)
            log.warning("kernels ahead: ignoring %s (%s)", path, e)
            entries = {}
        return cls(path, entries if isinstance(entries, dict) else {})

    def compiled(self, job: str) -> Any:
        """The job's result (its key, or list of keys) if every one of its kernels is on disk,
        else None."""
        result = self.entries.get(job)
        keys = result_keys(result)
        if self.path is None or keys is None:
            return None
        return result if all(on_disk(self.path.parent, k) for k in keys) else None

    def record(self, job: str, result: Any) -> None:
        if result_keys(result) is not None and self.entries.get(job) != result:
            self.entries[job] = result
            self.changed = True

    def save(self) -> None:
        if not self.changed or self.path is None:
            return
        tmp = self.path.with_name(f"{LEDGER}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.path)  # (another process's ledger: one of the two wins)
        except OSError as e:
            log.warning("kernels ahead: cannot write %s (%s)", self.path, e)
        self.changed = False
