"""Fit the constants of the FB path cost model (prunopt/ops/interspace.py) on
this machine, and report how often the model picks the faster path.

Times both paths single-threaded on the 9 VGG16-CIFAR layer shapes and 5
smaller ones at batch 1,
3x3, orthonormal basis, for several coefficient densities: dense =
F.conv2d(x, reconstructed filters) (what FBConv2d.eval() runs when it picks the
dense path, the filters cached), sparse = prunopt::fb_conv2d_csr on a CSR built
once (the eval sparse path). Then least squares on relative errors:

    dense  = u * (W * (P + s / P_img) + d0)        W = C_out C_in K
    sparse = u * (a nnz P + b nnz + m C_in N K P + f)

u (seconds per dense multiply-add), s and d0 from the dense timings, then a, b, m, f.
Prints the constants for ops_interspace's table and the picks of the fitted
model and of the current one.

    PYTHONPATH=. python tools/fit_fb_cost_model.py [--densities 0.01,0.03,...] [--timings FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from prunopt import ops
from prunopt.nn import FBConv2d, FilterBasis
from prunopt.ops.interspace import cost_constants, sparse_is_faster

# the VGG16-CIFAR layers, and smaller ones (narrow layers on small images),
# so that the fixed and per-map terms are not fitted on the large layers alone
SHAPES = [(3, 64, 32), (64, 64, 32), (64, 128, 16), (128, 128, 16), (128, 256, 8), (256, 256, 8), (256, 512, 4),
          (512, 512, 4), (512, 512, 2), (32, 32, 32), (64, 64, 8), (128, 128, 4), (256, 256, 2), (64, 64, 16)]


def _median(f, min_time=0.15, max_runs=200):
    f()
    ts = []
    start = time.perf_counter()
    while len(ts) < max_runs and (len(ts) < 5 or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure(densities):
    rows = []
    for c_in, c_out, hw in SHAPES:
        torch.manual_seed(0)
        fb = FBConv2d(c_in, c_out, 3, padding=1, basis=FilterBasis(3, init="orthonormal")).eval()
        x = torch.randn(1, c_in, hw, hw)
        g = fb.basis.weight.detach()
        for d in densities:
            fb.mask.copy_((torch.rand(fb.mask.shape) < d).float())
            w = fb.reconstruct().detach()
            csr = ops.fb_compress(fb.coefficients.detach(), fb.mask)
            with torch.no_grad():
                td = _median(lambda: F.conv2d(x, w, None, padding=1))
                ts = _median(lambda: torch.ops.prunopt.fb_conv2d_csr(
                    x, csr.crow_indices, csr.col_indices, csr.values, g, None, [1, 1], [1, 1], [1, 1], 1))
            rows.append(dict(c_in=c_in, c_out=c_out, hw=hw, density=d, nnz=csr.values.numel(), dense=td, sparse=ts))
            print(f"{c_in:4d}->{c_out:4d} @{hw:2d} d={d:<5} dense {td * 1e6:8.1f} us  sparse {ts * 1e6:8.1f} us", flush=True)
    return rows


def fit(rows):
    k, n = 9, 9
    # dense: t = u W P + (u s) W / P_img + u d0, relative errors
    A = np.array([[r["c_out"] * r["c_in"] * k * r["hw"] ** 2, r["c_out"] * r["c_in"] * k / r["hw"] ** 2, 1.0]
                  for r in rows])
    t = np.array([r["dense"] for r in rows])
    (u, us, ud), *_ = np.linalg.lstsq(A / t[:, None], np.ones(len(t)), rcond=None)
    s, d0 = us / u, ud / u
    B = np.array([[r["nnz"] * r["hw"] ** 2, r["nnz"], r["c_in"] * n * k * r["hw"] ** 2, 1.0] for r in rows])
    ts = np.array([r["sparse"] for r in rows]) / u
    coef, *_ = np.linalg.lstsq(B / ts[:, None], np.ones(len(ts)), rcond=None)
    return dict(per_mac=coef[0], per_nnz=coef[1], maps_per_mac=coef[2], fixed=coef[3], dense_small_image=s,
                dense_fixed=d0), u


def picks(rows, consts):
    good, lost = 0, []
    for r in rows:
        sparse_pick = sparse_is_faster(r["nnz"], r["c_out"], r["c_in"], r["c_in"], 9, 9, r["hw"] ** 2, constants=consts)
        best_sparse = r["sparse"] < r["dense"]
        if sparse_pick == best_sparse:
            good += 1
        else:
            lost.append((max(r["sparse"], r["dense"]) / min(r["sparse"], r["dense"]),
                         f'{r["c_in"]}->{r["c_out"]} @{r["hw"]} d={r["density"]}'))
    return good, lost


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--densities", default="0.01,0.03,0.1,0.3,0.5,0.7")
    ap.add_argument("--timings", help="JSON file: read the timings from it if it exists, else measure and write it")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.timings and os.path.exists(args.timings):
        with open(args.timings) as f:
            rows = json.load(f)
    else:
        rows = measure([float(d) for d in args.densities.split(",")])
        if args.timings:
            with open(args.timings, "w") as f:
                json.dump(rows, f, indent=1)
    consts, u = fit(rows)
    print(f"\nseconds per dense multiply-add: {u:.3e} ({1e-9 / u:.1f} GMAC/s)")
    print("fitted:", {k: round(float(v), 3) for k, v in consts.items()})
    for name, c in (("current", cost_constants()), ("fitted", consts)):
        good, lost = picks(rows, c)
        worst = ", misses: " + ", ".join(f"{w} ({x:.2f}x)" for x, w in sorted(lost, reverse=True)) if lost else ""
        print(f"{name} constants pick the faster path in {good} of {len(rows)} cases{worst}")


if __name__ == "__main__":
    main()
