"""The test extra installs the model zoo without replacing the CPU torch.

CI installs the package with ``pip install --no-build-isolation -e ".[test]"``
after ``torch==2.13.0`` (the CPU build). transformers must then be importable
and torch still that build: nothing in the extra may pull another torch. The
second test checks the same offline, from the installed distributions'
metadata: every requirement on ``torch`` reachable from the ``[test]`` extra
is satisfied by the installed torch, so pip never had (and never will have)
a reason to replace it. CI sets ``PRUNOPT_REQUIRE_TEST_EXTRAS=1``: a test
session then refuses to start when the extra does not import, so the zoo tests
cannot pass by skipping.
"""
import importlib.metadata as md
import importlib.util
import os
import re
import sys

import pytest
import torch

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_transformers_importable_with_the_cpu_torch():
    transformers = pytest.importorskip("transformers")
    import accelerate  # noqa: F401  (transformers.Trainer needs it)

    assert Version(transformers.__version__) >= Version("4.46")
    assert Version(torch.__version__).base_version == "2.13.0", torch.__version__
    assert torch.version.cuda is None and torch.version.hip is None, "torch is not the CPU build"


def _test_extra():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return [Requirement(r) for r in project["optional-dependencies"]["test"]] + \
        [Requirement(r) for r in project["dependencies"]]


def _requires(req: Requirement):
    """The requirements of the installed distribution ``req`` names, with the
    extras ``req`` asks for; ``None`` when it is not installed."""
    try:
        reqs = md.requires(req.name) or []
    except md.PackageNotFoundError:
        return None
    extras = [""] + sorted(req.extras)
    out = []
    for r in map(Requirement, reqs):
        if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras):
            out.append(r)
    return out


def test_no_requirement_of_the_test_extra_asks_for_another_torch():
    pytest.importorskip("transformers")
    torch_version = Version(md.version("torch"))
    seen, todo, torch_reqs = set(), _test_extra(), []
    while todo:
        req = todo.pop()
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key == "torch":
            torch_reqs.append(req)
            continue
        if (key, frozenset(req.extras)) in seen:
            continue
        seen.add((key, frozenset(req.extras)))
        deps = _requires(req)
        assert deps is not None, f"{req.name} (required through the test extra) is not installed"
        todo.extend(deps)
    assert {"transformers", "accelerate"} <= {name for name, _ in seen}
    for req in torch_reqs:
        assert req.specifier.contains(torch_version, prereleases=True), \
            f"{req} would replace the installed torch {torch_version}"


def test_ci_flag_refuses_a_session_without_the_test_extra(monkeypatch):
    """With PRUNOPT_REQUIRE_TEST_EXTRAS=1 (set by .ci/run) a transformers that
    does not import stops the session at its start, with the reason, instead of
    the zoo tests being skipped; without the flag the session starts."""
    spec = importlib.util.spec_from_file_location("_prunopt_root_conftest", os.path.join(ROOT, "tests", "conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    monkeypatch.setenv("PRUNOPT_REQUIRE_EXTENSION", "0")
    monkeypatch.setenv("PRUNOPT_REQUIRE_TEST_EXTRAS", "0")
    conftest.pytest_sessionstart(None)
    monkeypatch.setenv("PRUNOPT_REQUIRE_TEST_EXTRAS", "1")
    with pytest.raises(RuntimeError, match="PRUNOPT_REQUIRE_TEST_EXTRAS.*transformers"):
        conftest.pytest_sessionstart(None)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "export PRUNOPT_REQUIRE_TEST_EXTRAS=1" in f.read()
