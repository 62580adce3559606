"""Times the CPU kernels of two (or more) builds of the extension side by side.

Each build is a shared library that registers ``torch.ops.prunopt.*`` (a
``prunopt/_C.abi3.so`` or CMake's ``libprunopt_ops.so``). One process can hold
only one of them (the op names would clash), so every measurement runs in a
fresh worker process that loads one library with ``torch.ops.load_library``
(prunopt itself is not imported) and times the raw ops with
``torch.utils.benchmark`` (median of a blocked autorange). The contenders are
taken in turn for ``--rounds`` rounds, so a burst of load on a shared machine
hits them alike, and each keeps its smallest median per case. The table gives
those medians and the ratio of every contender to the first (> 1: slower than
the first; ``--vs LABEL=BASE`` takes LABEL's ratio against BASE instead), with
the median and range of that ratio within each round (the spread the host left).

A contender is ``LABEL=PATH`` or ``LABEL=PATH:VAR=VALUE,...`` (environment of
its workers, e.g. ``PRUNOPT_NO_AVX512=1`` to run a build's AVX2 clone)::

    cp /work/main/prunopt/_C.abi3.so /tmp/main_C.so   # a copy: a rebuild cannot change it mid-run
    python bench/compare_builds.py --ops gates --threads 1 \\
        main=/tmp/main_C.so new=prunopt/_C.abi3.so new-avx2=prunopt/_C.abi3.so:PRUNOPT_NO_AVX512=1 \\
        --out bench/results/simd_aten_gates.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

GATE_SIZES = [1 << 16, 1 << 20]
GATE_SHAPES = [(4096, 256), (64, 16384)]


def _gate_cases(torch, dtype):
    ops = torch.ops.prunopt
    gen = torch.Generator().manual_seed(0)
    dn = str(dtype).replace("torch.", "")
    for n in GATE_SIZES:
        x = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
        g = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
        w = x * 0.01
        yield f"rgf_relu fwd {dn} n={n}", lambda x=x: ops.rgf_relu(x, 0.1)
        yield f"rgf_relu bwd {dn} n={n}", lambda g=g, x=x: ops.rgf_relu_backward(g, x, 0.1)
        yield f"sigmoid fwd {dn} n={n}", lambda w=w: ops.two_temperature_sigmoid(w, 1000.0, 10.0)
        yield f"sigmoid bwd {dn} n={n}", lambda g=g, w=w: ops.two_temperature_sigmoid_backward(g, w, 10.0)
    for groups, k in GATE_SHAPES:
        alpha = torch.randn(groups, k, generator=gen, dtype=torch.float64)
        g = torch.randn(groups, k, generator=gen, dtype=torch.float64).to(dtype)
        for signed in (True, False):
            # thresholds that keep some gates open (as tests/ops/test_gates_simd.py)
            shift = -0.5 if signed else 0.3
            beta = torch.full((groups,), -float(torch.log(torch.tensor(float(k)))) + shift, dtype=torch.float64)
            a, b = alpha.to(dtype), beta.to(dtype)
            kind = "signed" if signed else "nonneg"
            yield (f"sparse_gate {kind} fwd {dn} {groups}x{k}",
                   lambda a=a, b=b, s=signed: ops.sparse_gate(a, b, s, 0.1))
            yield (f"sparse_gate {kind} bwd {dn} {groups}x{k}",
                   lambda g=g, a=a, b=b, s=signed: ops.sparse_gate_backward(g, a, b, s, 0.1))


def _prunadag_cases(torch, dtype):
    ops = torch.ops.prunopt
    gen = torch.Generator().manual_seed(0)
    dn = str(dtype).replace("torch.", "")
    # ~1.3M elements over three tensors (beyond the caches: memory bound), and
    # ~66K (in L2: the arithmetic of the passes shows)
    for shapes, version in [(s, v) for s in ([(1024, 1024), (512, 512), (1000,)], [(256, 256), (1000,)])
                            for v in (0, 3)]:
        params = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
        grads = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) * 1e-2 for s in shapes]
        opt = [torch.full(s, 1e-3, dtype=dtype) for s in shapes]
        dec = [torch.zeros(s, dtype=dtype) for s in shapes]
        # columns: lr_k, lr_k1, weight_decay, eps, maximize, prune
        hyper = torch.tensor([[1e-3, 1e-3, 1e-4, 1e-10, 0.0, 1.0]] * len(shapes), dtype=torch.float64)
        n = sum(p.numel() for p in params)
        yield (f"prunadag_step_ v{version} {dn} n={n}",
               lambda p=params, o=opt, d=dec, g=grads, h=hyper, v=version: ops.prunadag_step_(
                   p, o, d, g, h, n // 10, v))


def _projection_cases(torch, dtype):
    ops = torch.ops.prunopt
    gen = torch.Generator().manual_seed(0)
    dn = str(dtype).replace("torch.", "")
    # unit costs (float32 takes the vectorised passes; float64 the scalar loops
    # on every capability: a same-code control); 64K in L2, 1M, 8M beyond the
    # caches (the output pass streams); the histogram solver (the fallback when
    # the sample misleads; forced by PRUNOPT_PROJECTION_SOLVER, read per call)
    for n in (1 << 16, 1 << 20, 1 << 23):
        t = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
        yield f"project_budget {dn} n={n}", lambda t=t, n=n: ops.project_budget([t], None, n / 10)
    t = torch.randn(1 << 20, generator=gen, dtype=torch.float64).to(dtype)

    def histogram(t=t):
        os.environ["PRUNOPT_PROJECTION_SOLVER"] = "histogram"
        try:
            return ops.project_budget([t], None, t.numel() / 10)
        finally:
            del os.environ["PRUNOPT_PROJECTION_SOLVER"]
    yield f"project_budget histogram {dn} n={1 << 20}", histogram


def fb_reconstruct_pair(torch, dtype, gen, co, ci, nb, kh, kw, masked=True, prefix="fb_reconstruct "):
    """``(name, call)`` of the forward and of the backward of fb_reconstruct on
    random coefficients ``(co, ci, nb)`` and a basis ``(nb, kh, kw)``, with a
    half-zero mask (as the layers call it) or none."""
    ops = torch.ops.prunopt
    dn = str(dtype).replace("torch.", "")
    lam = torch.randn(co, ci, nb, generator=gen, dtype=torch.float64).to(dtype)
    basis = torch.randn(nb, kh, kw, generator=gen, dtype=torch.float64).to(dtype)
    mu = (torch.rand(co, ci, nb, generator=gen) < 0.5).to(dtype) if masked else None
    gh = torch.randn(co, ci, kh, kw, generator=gen, dtype=torch.float64).to(dtype)
    shape = f"{co}x{ci}x{nb} {kh}x{kw}" + ("" if masked else " no mask")
    yield f"{prefix}fwd {dn} {shape}", lambda: ops.fb_reconstruct(lam, basis, mu)
    yield f"{prefix}bwd {dn} {shape}", lambda: ops.fb_reconstruct_backward(gh, lam, basis, mu, [True, True])


def _fb_reconstruct_cases(torch, dtype):
    gen = torch.Generator().manual_seed(0)
    # (C_out, C_in, N, kh, kw): the 3x3 basis of a 256-channel layer (float: its
    # own AVX2 / AVX-512VL loops), and a 5x5 one with N = 12 (the generic rows)
    for co, ci, nb, kh, kw in ((256, 256, 9, 3, 3), (128, 128, 12, 5, 5)):
        yield from fb_reconstruct_pair(torch, dtype, gen, co, ci, nb, kh, kw)


# C_out = C_in and whether masked: the 3x3 basis (N = K = 9) of every 3x3
# filter-basis layer in training, 64 (36K floats a tensor, in L2), 256 and 512
# (beyond it); with the pruning mask (as the layers call it) and, at 256, without
FB_3X3_SHAPES = ((64, True), (256, True), (256, False), (512, True))


def _fb_reconstruct_3x3_cases(torch, dtype):
    gen = torch.Generator().manual_seed(0)
    for co, masked in FB_3X3_SHAPES:
        yield from fb_reconstruct_pair(torch, dtype, gen, co, co, 9, 3, 3, masked)


def _prunadag_single_cases(torch, dtype):
    ops = torch.ops.prunopt
    gen = torch.Generator().manual_seed(0)
    dn = str(dtype).replace("torch.", "")
    # one tensor of 64K (256x256, in L2) or 1M (1024x1024) elements, version 0
    # (the fused step of prunopt.optim.PrunAdag on one parameter)
    for shape in ((256, 256), (1024, 1024)):
        p = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        g = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) * 1e-2
        o, d = torch.full(shape, 1e-3, dtype=dtype), torch.zeros(shape, dtype=dtype)
        hyper = torch.tensor([[1e-3, 1e-3, 1e-4, 1e-10, 0.0, 1.0]], dtype=torch.float64)
        n = p.numel()
        yield (f"prunadag_step_ v0 {dn} one tensor n={n}",
               lambda p=p, o=o, d=d, g=g, h=hyper, n=n: ops.prunadag_step_([p], [o], [d], [g], h, n // 10, 0))


CASES = {"gates": _gate_cases, "prunadag": _prunadag_cases, "projection": _projection_cases,
         "fb_reconstruct": _fb_reconstruct_cases, "fb_reconstruct_3x3": _fb_reconstruct_3x3_cases,
         "prunadag_single": _prunadag_single_cases}


def worker(lib: str, ops: list, dtypes: list, threads: int, min_time: float, only: str = "",
           stat: str = "median") -> None:
    """Loads one build and prints {case: seconds} as JSON (the median or the
    smallest of the blocked autorange's blocks)."""
    import torch
    import torch.utils.benchmark as benchmark

    torch.set_num_threads(threads)
    torch.ops.load_library(lib)
    out = {}
    for group in ops:
        for dt in dtypes:
            for name, fn in CASES[group](torch, getattr(torch, dt)):
                if only and not any(o in name for o in only.split(",")):
                    continue
                fn()  # warm up (first touch, thread pool)
                t = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
                m = t.blocked_autorange(min_run_time=min_time)
                out[name] = m.median if stat == "median" else min(m.times)
    print(json.dumps(out))


def _parse_contender(spec: str):
    label, _, rest = spec.partition("=")
    path, _, env = rest.partition(":")
    extra = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    if not label or not os.path.isfile(path):
        raise SystemExit(f"contender {spec!r}: expected LABEL=PATH[:VAR=VALUE,...] with an existing PATH")
    return label, os.path.abspath(path), extra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("contenders", nargs="*", help="LABEL=PATH[:VAR=VALUE,...]; the first is the baseline")
    p.add_argument("--ops", default="gates", help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--dtypes", default="float32,float64")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-time", type=float, default=0.2, help="seconds of blocked autorange per case and worker")
    p.add_argument("--only", default="", help="comma-separated substrings: time only the cases naming one")
    p.add_argument("--vs", default="", help="comma-separated LABEL=BASE: the contender LABEL's ratios are taken "
                   "against BASE instead of the first contender")
    p.add_argument("--out", help="write the markdown table here (and the raw figures beside it as .json)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="per worker and case: the median of the timed blocks, or the smallest (less sensitive to "
                   "other processes' bursts on a shared host)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    ops, dtypes = args.ops.split(","), args.dtypes.split(",")
    if args.worker:
        return worker(args.worker, ops, dtypes, args.threads, args.min_time, args.only, args.stat)
    from prunopt.bench.common import cpu_model  # (the parent only: a worker loads nothing but its build)

    if args.out:  # checked before any timing: its folder is made, a folder as the file is refused
        if os.path.isdir(args.out):
            raise SystemExit(f"--out {args.out!r} is a directory: give the markdown file's path")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    if len(args.contenders) < 2:
        raise SystemExit("give at least two contenders (the first is the baseline)")
    contenders = [_parse_contender(c) for c in args.contenders]
    labels = [c[0] for c in contenders]
    vs = dict(kv.split("=", 1) for kv in args.vs.split(",") if kv)
    for lb, bs in vs.items():
        if lb not in labels or bs not in labels:
            raise SystemExit(f"--vs {lb}={bs}: both must be contender labels ({', '.join(labels)})")
    best = {label: {} for label, _, _ in contenders}
    rounds = {label: {} for label, _, _ in contenders}  # every round's median, per case
    for r in range(args.rounds):
        for label, path, extra in contenders:
            env = dict(os.environ, **extra)
            env.pop("PRUNOPT_EXTENSION_LIBRARY", None)
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, "--ops", args.ops, "--dtypes",
                   args.dtypes, "--threads", str(args.threads), "--min-time", str(args.min_time), "--only", args.only, "--stat", args.stat]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if res.returncode != 0:
                raise SystemExit(f"worker {label} failed:\n{res.stderr}")
            for case, t in json.loads(res.stdout.strip().splitlines()[-1]).items():
                best[label][case] = min(best[label].get(case, float("inf")), t)
                rounds[label].setdefault(case, []).append(t)
            print(f"round {r + 1}/{args.rounds}: {label} done", file=sys.stderr)
    base = contenders[0][0]
    pairs = [(lb, vs.get(lb, base)) for lb in labels[1:] if vs.get(lb, base) != lb]
    # per pair: the ratio of the best medians, and the range of the ratios
    # within each round (the two contenders timed minutes apart at most)
    head = "| case | " + " | ".join(f"{lb} ms" for lb in labels) + " | " + " | ".join(
        f"{lb} / {bs} | per round" for lb, bs in pairs) + " |"
    lines = [head, "|" + "---|" * (1 + len(labels) + 2 * len(pairs))]
    for case in best[base]:
        ms = [best[lb][case] * 1e3 for lb in labels]
        cells = []
        for lb, bs in pairs:
            per = [a / b for a, b in zip(rounds[lb][case], rounds[bs][case])]
            cells += [f"{best[lb][case] / best[bs][case]:.3f}",
                      f"{statistics.median(per):.3f} ({min(per):.2f}-{max(per):.2f})"]
        lines.append(f"| {case} | " + " | ".join(f"{v:.4g}" for v in ms) + " | " + " | ".join(cells) + " |")
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    what = "median" if args.stat == "median" else "smallest block"
    desc = "; ".join(f"{lb} = {path}" + (f" with {extra}" if extra else "") for lb, path, extra in contenders)
    header = (f"date={datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, "
              f"cpu={cpu_model()}, logical_cpus={os.cpu_count()}, threads={args.threads}, rounds={args.rounds}, "
              f"min_time={args.min_time}s per case and worker, load average at the end (1, 5, 15 min): {load}\n\n"
              f"Contenders: {desc}. Figures: the smallest over the rounds of each worker's {what} "
              f"(torch.utils.benchmark blocked autorange), raw ops (torch.ops.prunopt.*), CPU; 'per round': the "
              f"ratio of the two contenders' figures within each round: its median (min-max).\n")
    table = header + "\n" + "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"contenders": [{"label": lb, "library": pth, "env": ex} for lb, pth, ex in contenders],
                       "threads": args.threads, "rounds": args.rounds, "seconds": best, "seconds_per_round": rounds},
                      f, indent=1)


if __name__ == "__main__":
    main()
