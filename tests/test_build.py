"""The compiled extension links the C++ runtime as torch does.

A g++ that links libstdc++ statically into ``prunopt._C`` (seen on the lent
H100 machine: ``/opt/gcc/bin/g++`` is a wrapper whose ``-B`` paths pick the
static archive) gives the extension a second copy of the iostream and locale
code; the first error an op raises then crashes the process while formatting
its message (a segfault in ``std::ostream::_M_insert<double>``). The fix is
to build with a compiler that links the shared runtime (README, Development).
"""
import shutil
import subprocess

import pytest
import torch

import prunopt

needs_ext = pytest.mark.skipif(not prunopt.extension_available(), reason="needs the compiled extension")


@needs_ext
@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_extension_does_not_embed_libstdcxx():
    from prunopt import _C

    out = subprocess.run(["nm", "-D", "--defined-only", _C.__file__], capture_output=True, text=True, check=True)
    names = [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]
    embedded = [n for n in names if n.startswith(("_ZNSo", "_ZNSt6locale", "_ZNKSt7codecvt"))]
    assert not embedded, (f"prunopt._C defines {len(embedded)} libstdc++ symbols (e.g. {embedded[:3]}): it was "
                          "linked against a static libstdc++; rebuild with CXX=/usr/bin/g++ (see README)")


@needs_ext
def test_op_errors_are_value_errors_with_numbers_in_the_message():
    # the message carries a double: the path that crashed with an embedded libstdc++
    with pytest.raises(ValueError, match="budget"):
        torch.ops.prunopt.project_budget([torch.rand(3)], None, -1.5)
