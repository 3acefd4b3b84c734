"""constraints.txt locks what the README installs: every dependency, inside pyproject's range."""
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_lock_pins_every_dependency_inside_pyproject_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = project["dependencies"] + project["optional-dependencies"]["test"]
    reqs = [Requirement(r) for r in names]
    pins = _pins()
    for req in reqs:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in constraints.txt"
        assert req.specifier.contains(pins[name]), \
            f"{req.name}: {pins[name]} is outside {req.specifier}"
        upper = [s for s in req.specifier if s.operator == "<"]
        assert upper, f"pyproject: {req} has no upper bound (cap it at the next major version)"
    assert pins["triton"] == Version("3.6.0")  # the GPU image's Triton


def test_readme_commands_install_from_the_lock():
    readme = (ROOT / "README.md").read_text()
    for marker in ("<!-- demo-command -->", "<!-- test-command -->"):
        block = readme.split(marker, 1)[1]
        command = re.search(r"^python3 .*$", block, re.M).group(0)
        assert "pip install -c constraints.txt " in command, command
