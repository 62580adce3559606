"""Every op registered by the extension has a pure-PyTorch reference, a CPU
kernel and a CUDA kernel, and its schema lives in csrc/ops.cpp."""
import os
import re

import pytest
import torch

import prunopt
from prunopt.reference import REFERENCE_FOR_OP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _schema_names():
    with open(os.path.join(ROOT, "csrc", "ops.cpp")) as f:
        text = f.read()
    return sorted(set(re.findall(r'"([a-z_0-9]+)\(', text)))


def test_every_schema_has_a_reference():
    names = _schema_names()
    assert "project_budget" in names
    missing = [n for n in names if n not in REFERENCE_FOR_OP]
    assert not missing, f"ops without a reference: {missing}"
    assert all(callable(f) for f in REFERENCE_FOR_OP.values())


@pytest.mark.skipif(not prunopt.extension_available(), reason="compiled extension not built")
def test_every_schema_has_cpu_kernel_and_cuda_source():
    cuda_sources = ""
    for f in os.listdir(os.path.join(ROOT, "csrc", "cuda")):
        with open(os.path.join(ROOT, "csrc", "cuda", f)) as fh:
            cuda_sources += fh.read()
    for name in _schema_names():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"prunopt::{name}", "CPU"), name
        assert f'"{name}"' in cuda_sources, f"no CUDA registration for {name}"
