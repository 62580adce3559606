"""Times fb_reconstruct's float 3x3 loops against its generic rows in one process.

The CPU op picks its path per call from the environment:
``PRUNOPT_FB_GENERIC_3X3=1`` sends the float 3x3 basis (N = K = 9) to the
generic at::vec::Vectorized rows instead of the hand-written loops, and
``PRUNOPT_NO_AVX512=1`` selects the AVX2 clone of either. So one process, one
build and the same tensors can time all four side by side: each repetition
times a burst of calls (about ``--burst-ms``) of every contender in turn, the
order rotated from one repetition to the next, so a burst of load from the
rest of a shared machine falls on neighbouring bursts of every contender
alike. Per case it prints each contender's median over the repetitions and,
for a pair, the median and the quartiles of the per-repetition ratio (the
two bursts a few milliseconds apart)::

    python bench/fb_reconstruct_3x3_paths.py --threads 1 --reps 41
    python bench/fb_reconstruct_3x3_paths.py --lib /tmp/other_C.so   # a build other than the installed one

Raw ops (torch.ops.prunopt.*), CPU, float32 (and float64 as a control:
``--control``, the generic rows under every setting, so its ratios are the
noise of the method).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

from compare_builds import FB_3X3_SHAPES, fb_reconstruct_pair

CONTENDERS = {  # label: environment
    "hand": {},
    "generic": {"PRUNOPT_FB_GENERIC_3X3": "1"},
    "hand-avx2": {"PRUNOPT_NO_AVX512": "1"},
    "generic-avx2": {"PRUNOPT_NO_AVX512": "1", "PRUNOPT_FB_GENERIC_3X3": "1"},
}
PAIRS = [("generic", "hand"), ("generic-avx2", "hand-avx2")]


def _cases(torch, dtype):
    gen = torch.Generator().manual_seed(0)
    for co, masked in FB_3X3_SHAPES:
        yield from fb_reconstruct_pair(torch, dtype, gen, co, co, 9, 3, 3, masked, prefix="")


def _set_env(env):
    for var in ("PRUNOPT_FB_GENERIC_3X3", "PRUNOPT_NO_AVX512"):
        os.environ.pop(var, None)
    os.environ.update(env)


def _burst(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=41, help="repetitions (bursts per contender and case)")
    p.add_argument("--burst-ms", type=float, default=5.0, help="length of one burst of calls")
    p.add_argument("--control", action="store_true", help="also float64 (same code under every setting)")
    p.add_argument("--lib", help="load this build (a prunopt/_C.abi3.so) instead of importing prunopt")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.lib:
        torch.ops.load_library(args.lib)
    else:
        import prunopt  # noqa: F401  (registers the ops)
    dtypes = [torch.float32] + ([torch.float64] if args.control else [])
    labels = list(CONTENDERS)
    print(f"date={datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, "
          f"threads={args.threads}, reps={args.reps}, burst={args.burst_ms} ms, "
          f"load average (1, 5, 15 min) at the start: {', '.join(f'{v:.1f}' for v in os.getloadavg())}\n")
    head = "| case | " + " | ".join(f"{lb} ms" for lb in labels) + " | " + " | ".join(
        f"{a} / {b} (quartiles)" for a, b in PAIRS) + " |"
    print(head)
    print("|" + "---|" * (1 + len(labels) + len(PAIRS)))
    try:
        for dtype in dtypes:
            for name, fn in _cases(torch, dtype):
                calls = {}
                for lb in labels:  # warm up each path, size its burst
                    _set_env(CONTENDERS[lb])
                    fn()
                    calls[lb] = max(1, int(args.burst_ms * 1e-3 / max(_burst(fn, 3), 1e-7)))
                times = {lb: [] for lb in labels}
                for r in range(args.reps):
                    order = labels[r % len(labels):] + labels[:r % len(labels)]
                    for lb in order:
                        _set_env(CONTENDERS[lb])
                        times[lb].append(_burst(fn, calls[lb]))
                cells = [f"{statistics.median(times[lb]) * 1e3:.4g}" for lb in labels]
                for a, b in PAIRS:
                    q = statistics.quantiles([x / y for x, y in zip(times[a], times[b])], n=4)
                    cells.append(f"{q[1]:.3f} ({q[0]:.2f}-{q[2]:.2f})")
                print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    finally:
        _set_env({})
    print(f"\nload average (1, 5, 15 min) at the end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
