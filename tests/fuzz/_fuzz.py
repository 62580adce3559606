"""Helpers of the fuzz suite (tests/fuzz): the example budget, tensors drawn
from a seed, snapshots that prove nothing was written, the error contract and
fake-tensor calls."""
from __future__ import annotations

import os
import warnings
from typing import Iterable, List, Sequence

import torch
from hypothesis import HealthCheck, settings

#: Examples per fuzz test: a few dozen in the default run (the directory takes
#: seconds), PRUNOPT_FUZZ_EXAMPLES=N for long runs (which also draw fresh
#: random examples instead of the default run's fixed ones).
LONG = "PRUNOPT_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("PRUNOPT_FUZZ_EXAMPLES", "25"))

fuzz_settings = settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                HealthCheck.filter_too_much],
                         **({} if LONG else {"database": None}))

#: The exceptions a bad argument may raise: the library's contract.
CLEAN = (ValueError, TypeError, RuntimeError)

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


def tensor(shape: Sequence[int], dtype: torch.dtype, seed: int, scale: float = 1.0, special: str = "none",
           low: float = None) -> torch.Tensor:
    """A float tensor from ``seed``: normal values times ``scale`` (uniform in
    [low, low + scale) when ``low`` is given), then ``special`` values in a few
    places: "zeros", "extreme" (+-1e30 / the dtype's extremes), "tiny"
    (subnormals), "nan", "inf" or "none"."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if low is None:
        x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    else:
        x = torch.rand(n, generator=g, dtype=torch.float64) * scale + low
    if n and special != "none":
        idx = torch.randperm(n, generator=g)[: max(1, n // 4)]
        fi = torch.finfo(dtype)
        vals = {"zeros": [0.0, -0.0], "extreme": [min(1e30, fi.max), -min(1e30, fi.max), fi.max / 4],
                "tiny": [fi.tiny / 4, -fi.tiny / 8, fi.tiny], "nan": [float("nan")],
                "inf": [float("inf"), -float("inf")]}[special]
        for j, i in enumerate(idx.tolist()):
            x[i] = vals[j % len(vals)]
    return x.to(dtype).reshape(tuple(shape))


def tensors_in(obj) -> Iterable[torch.Tensor]:
    """Every tensor in an argument list (nested lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)


def snapshot(args) -> List[torch.Tensor]:
    """Copies of every tensor in ``args`` (to compare after a failed call)."""
    return [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors_in(args)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bits (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_meta or b.is_meta:  # no data
        return a.is_meta and b.is_meta
    a, b = a.detach().contiguous(), b.detach().contiguous()
    if a.dtype in _INT_VIEW:
        return torch.equal(a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype]))
    return torch.equal(a, b)


def assert_unchanged(args, before: List[torch.Tensor], what: str) -> None:
    after = list(tensors_in(args))
    assert len(after) == len(before)
    for i, (a, b) in enumerate(zip(after, before)):
        assert same_bits(a, b), f"{what}: tensor {i} of the arguments was written before the error"


def assert_clean_error(exc: BaseException, names: Sequence[str], what: str) -> None:
    """A ValueError/TypeError/RuntimeError whose message names one of ``names``."""
    assert isinstance(exc, CLEAN), f"{what}: {type(exc).__name__}: {exc}"
    msg = str(exc)
    assert any(n in msg for n in names), f"{what}: the message does not name {list(names)}: {msg}"


def call(fn, *args, **kwargs):
    """``(result, None)`` or ``(None, exception)``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - the test judges the type
        return None, exc


def call_fake(fn, args):
    """``fn(*args)`` with every tensor of ``args`` replaced by a fake tensor
    (the op's fake kernel runs): ``(result, None)`` or ``(None, exception)``."""
    import logging

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # (a shape environment: an output whose size depends on the data, as
    # topk_bracket's candidates, gets a symbolic size)
    mode = FakeTensorMode(allow_non_fake_inputs=False, shape_env=ShapeEnv())

    def fake(o):
        if isinstance(o, torch.Tensor):
            return mode.from_tensor(o)
        if isinstance(o, list):
            return [fake(x) for x in o]
        if isinstance(o, tuple):
            return tuple(fake(x) for x in o)
        return o

    fargs = [fake(a) for a in args]
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # a fake kernel's error is logged before it is raised
    try:
        with mode:
            return call(fn, *fargs)
    finally:
        logger.setLevel(level)


def metadata(out):
    """Shapes and dtypes of an op's output (a tensor, a list or a tuple); a
    symbolic size (a fake kernel's data-dependent one) is ``None``."""
    return [(tuple(d if isinstance(d, int) else None for d in t.shape), t.dtype) for t in tensors_in(out)]


def same_metadata(fake, real) -> bool:
    """The fake kernel's output metadata matches the real one's (a symbolic
    size matches any)."""
    return len(fake) == len(real) and all(
        fd == rd and len(fs) == len(rs) and all(f is None or f == r for f, r in zip(fs, rs))
        for (fs, fd), (rs, rd) in zip(fake, real))
