"""Imports run one way (entrypoints -> runtime -> engine -> layers; families plug in through
registries), model folders hold no engine services, and only config/env.py reads the
environment."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "omnistage"
# a layer -> packages it must never import
FORBIDDEN = {
    "config": ("omnistage.models", "omnistage.engine", "omnistage.runtime",
               "omnistage.entrypoints", "torch"),
    "engine": ("omnistage.runtime", "omnistage.models", "omnistage.entrypoints"),
    "runtime": ("omnistage.entrypoints",),
    "models": ("omnistage.entrypoints",),
}
# engine services a model folder must leave to the engines (threads, graphs, streams)
SERVICES = ("threading", "concurrent.futures", "CUDAGraph", "torch.cuda.graph",
            "torch.cuda.Stream", "private_stream", "green_context_stream", "ThreadPoolExecutor")


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def test_imports_run_one_way():
    bad = []
    for path, tree in _modules():
        layer = path.relative_to(PKG).parts[0]
        for name in _imports(tree):
            for banned in FORBIDDEN.get(layer, ()):
                if name == banned or name.startswith(banned + "."):
                    bad.append(f"{path.relative_to(PKG)} imports {name}")
    assert not bad, "\n".join(bad)


def test_model_folders_use_engine_services_only_through_the_engines():
    bad = []
    for path, tree in _modules():
        if path.relative_to(PKG).parts[0] != "models":
            continue
        used = set(_imports(tree)) | {_dotted(n) for n in ast.walk(tree)
                                      if isinstance(n, (ast.Attribute, ast.Name))}
        for name in used:
            if any(name == s or name.startswith(s + ".") or name.endswith("." + s)
                   for s in SERVICES):
                bad.append(f"{path.relative_to(PKG)} uses {name}")
        bad += [f"{path.relative_to(PKG)} defines {n.name}" for n in ast.walk(tree)
                if isinstance(n, ast.ClassDef)
                and n.name.endswith(("Stage", "Scheduler", "Engine"))]
    assert not bad, "\n".join(sorted(set(bad)))


def test_only_the_env_module_reads_the_environment():
    bad = []
    for path, tree in _modules():
        if path.relative_to(PKG).as_posix() == "config/env.py":
            continue
        for node in ast.walk(tree):
            if _dotted(node) in ("os.environ", "os.getenv", "os.putenv"):
                bad.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not bad, "os.environ outside omnistage/config/env.py:\n" + "\n".join(bad)


def test_at_most_three_omnistage_variables():
    names = set()
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        names |= {w.strip("\"'`$(),.:;") for w in text.split() if "OMNISTAGE_" in w}
    names = {n[n.index("OMNISTAGE_"):] for n in names}
    assert names <= {"OMNISTAGE_API_KEY", "OMNISTAGE_CACHE_DIR", "OMNISTAGE_LOG_LEVEL"}, names
