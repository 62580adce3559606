"""``prunopt bench``: every benchmark is found and runs from a source checkout
and from an installed package, writing only where ``--out`` points (default: a
new ``./prunopt-bench-<time>``)."""
import os
import shutil
import sys

import pytest

import prunopt
from prunopt.bench import run as bench_run
from prunopt.bench.common import BenchmarkSkipped

from _job_helpers import ROOT, run_child

EXPECTED = ["distributed", "gates", "gpu", "interspace", "masking", "projection", "prunadag"]


def _installed_copy(tmp_path):
    """The package as an install puts it: ``prunopt/`` alone in a site folder,
    no checkout (and no ``bench/results``) beside it."""
    site = tmp_path / "site"
    shutil.copytree(os.path.dirname(prunopt.__file__), site / "prunopt",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return site


def test_every_benchmark_has_a_run():
    import importlib

    assert bench_run.discover() == EXPECTED
    for name in EXPECTED:
        assert callable(importlib.import_module(f"prunopt.bench.bench_{name}").run), name


def test_gpu_benchmark_skips_without_cuda(tmp_path):
    import torch

    from prunopt.bench import bench_gpu

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark would run")
    with pytest.raises(BenchmarkSkipped, match="no CUDA"):
        bench_gpu.run(quick=True, threads=1, out=str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_quick_bench_from_an_installed_package(tmp_path):
    site = _installed_copy(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(PYTHONPATH=str(site))
    found = run_child([sys.executable, "-c", "import prunopt, prunopt.bench.run as r; print(prunopt.__file__); "
                       "print(' '.join(r.discover()))"], cwd=str(work), **env)
    assert found.returncode == 0, found.stderr
    where, names = found.stdout.splitlines()
    assert where.startswith(str(site)) and names.split() == EXPECTED
    committed = sorted(os.listdir(os.path.join(ROOT, "bench", "results")))
    r = run_child([sys.executable, "-m", "prunopt", "bench", "--quick", "--only", "gates", "--only", "gpu",
                   "--max-time", "0.01", "--threads", "1"], cwd=str(work), **env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "== gpu" in r.stdout and ("skipped: no CUDA device" in r.stdout or "gpu.md" in os.listdir(work))
    (out,) = os.listdir(work)  # one new results directory in the current one, nothing else
    assert out.startswith("prunopt-bench-")
    assert {"gates.json", "gates.md", "index.md"} <= set(os.listdir(work / out))
    assert "[gates](gates.md)" in (work / out / "index.md").read_text()
    assert not any(f.endswith((".json", ".md")) for f in os.listdir(site / "prunopt" / "bench"))
    assert sorted(os.listdir(os.path.join(ROOT, "bench", "results"))) == committed


def test_bench_usage_errors(capsys):
    from prunopt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--only", "nope"])
    assert e.value.code == 2 and "unknown benchmark(s) nope" in capsys.readouterr().err
    assert main(["bench", "--list"]) == 0
    assert capsys.readouterr().out.split() == EXPECTED


def test_bench_out_is_where_results_go(tmp_path, monkeypatch):
    from prunopt.bench import common

    monkeypatch.chdir(tmp_path)
    with common.max_time(0.01):
        assert common.median_time(lambda: None, min_run_time=5.0) >= 0
    monkeypatch.setattr(common, "_default_out", None)
    first = common.default_out_dir()
    assert os.path.dirname(first) == str(tmp_path) and os.path.basename(first).startswith("prunopt-bench-")
    assert common.default_out_dir() == first  # one directory per process
    md = common.write_results("x", [{"a": 1.0}], {"cpu": "test"}, out_dir=str(tmp_path / "chosen"))
    assert "| a |" in md and sorted(os.listdir(tmp_path / "chosen")) == ["x.json", "x.md"]
