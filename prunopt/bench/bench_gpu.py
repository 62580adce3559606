"""CUDA benchmarks of prunAdag and the filter-basis convolution (run where a
GPU is lent; without CUDA, :func:`run` raises ``BenchmarkSkipped`` and the
runner goes on):

* prunAdag: fused PrunAdag step (version 3, relevant=0.1, global scope) against
  ``torch.optim.Adagrad(foreach=True)`` (torch has no fused Adagrad on CUDA) and
  the foreach and single-tensor PrunAdag paths, one
  tensor of 10M and 50 model-like tensors totalling 10M, float32; the
  threshold op against ``torch.kthvalue`` on the concatenation.
* filter-basis training: forward + backward of ``FBConv2d`` against
  ``nn.Conv2d`` on the VGG16-CIFAR layer shapes at batch 32 (cuDNN).

Every contender is checked against the others first. Medians of
``torch.utils.benchmark`` (which synchronises CUDA). Writes ``gpu.json`` and
``gpu.md``. Run: ``prunopt bench --only gpu [--quick] [--out DIR]`` or
``python -m prunopt.bench.bench_gpu [--quick] [--out DIR]``. ``--quick``: 1M
parameters instead of 10M and the first four layer shapes.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from prunopt.bench.bench_interspace import VGG16_CIFAR
from prunopt.bench.bench_prunadag import _sizes
from prunopt.bench.common import BenchmarkSkipped, environment, median_time, write_results


def _prunadag_rows(total: int = 10_000_000, min_time: float = 1.0):
    from prunopt.optim import PrunAdag

    rows = []
    for label, count in (("1 tensor", 1), ("50 tensors", 50)):
        sizes = _sizes(total, count)
        g = torch.Generator(device="cuda").manual_seed(0)

        def params():
            ps = [torch.randn(s, generator=g, device="cuda").requires_grad_() for s in sizes]
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g, device="cuda")
            return ps

        base = params()
        clone = lambda: [torch.nn.Parameter(p.detach().clone()) for p in base]  # noqa: E731
        ps_f, ps_e = clone(), clone()
        for a, b, p in zip(ps_f, ps_e, base):
            a.grad, b.grad = p.grad.clone(), p.grad.clone()
        ps_s = clone()
        for a, p in zip(ps_s, base):
            a.grad = p.grad.clone()
        single = PrunAdag(ps_s, lr=0.1, relevant=0.1, foreach=False, fused=False)
        fused = PrunAdag(ps_f, lr=0.1, relevant=0.1, fused=True)
        fe = PrunAdag(ps_e, lr=0.1, relevant=0.1, foreach=True)
        fused.step()
        fe.step()
        err = max((a - b).abs().max().item() for a, b in zip(ps_f, ps_e))
        assert err < 1e-5, f"fused and foreach PrunAdag differ by {err}"
        ps_a = clone()
        for a, p in zip(ps_a, base):
            a.grad = p.grad.clone()
        # torch's fused Adagrad has no CUDA kernel (torch 2.11: "fused=True requires ... cpu"):
        # the strongest CUDA peer is the foreach (multi-tensor-apply) path
        adagrad = torch.optim.Adagrad(ps_a, lr=0.1, foreach=True)
        grads = [p.grad for p in base]
        k = max(1, total // 10)
        flat = torch.cat([x.abs() for x in grads])
        assert torch.equal(torch.ops.prunopt.topk_threshold(grads, k), torch.kthvalue(flat, flat.numel() - k + 1).values)
        t = {
            "Adagrad(foreach=True)": median_time(adagrad.step, min_time, device="cuda"),
            "PrunAdag fused": median_time(fused.step, min_time, device="cuda"),
            "PrunAdag foreach": median_time(fe.step, min_time, device="cuda"),
            "PrunAdag single-tensor": median_time(single.step, min_time, device="cuda"),
            "topk_threshold": median_time(lambda: torch.ops.prunopt.topk_threshold(grads, k), min_time, device="cuda"),
            "torch.kthvalue(cat)": median_time(
                lambda: torch.kthvalue(torch.cat([x.abs() for x in grads]), flat.numel() - k + 1), min_time, device="cuda"),
        }
        for name, v in t.items():
            rows.append({"case": f"prunadag {label}", "contender": name, "median_ms": v * 1e3,
                         "vs_adagrad": v / t["Adagrad(foreach=True)"], "vs_fused_prunadag": v / t["PrunAdag fused"]})
    return rows


def _fb_rows(shapes=None, min_time: float = 0.5):
    from prunopt.nn import FBConv2d, FilterBasis

    rows = []
    for c_in, c_out, hw in shapes or sorted(set(VGG16_CIFAR), key=VGG16_CIFAR.index):
        torch.manual_seed(0)
        conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        fb = FBConv2d.from_conv2d(conv, FilterBasis(3, init="orthonormal"))
        fb.mask.bernoulli_(0.5)
        conv, fb = conv.cuda(), fb.cuda()
        x = torch.randn(32, c_in, hw, hw, device="cuda", requires_grad=True)
        torch.testing.assert_close(fb(x), F.conv2d(x, fb.reconstruct(), fb.bias, padding=1), atol=1e-3, rtol=1e-3)

        def step(m):
            y = m(x)
            y.backward(torch.ones_like(y))

        t_conv = median_time(lambda: step(conv), min_time, device="cuda")
        t_fb = median_time(lambda: step(fb), min_time, device="cuda")
        # the forward alone (with the graph recorded): the host's share of a small layer
        t_conv_fwd = median_time(lambda: conv(x), 0.6 * min_time, device="cuda")
        t_fb_fwd = median_time(lambda: fb(x), 0.6 * min_time, device="cuda")
        rows.append({"case": f"FB training {c_in}->{c_out} @{hw}x{hw}, batch 32", "contender": "FBConv2d vs nn.Conv2d",
                     "median_ms": t_fb * 1e3, "vs_adagrad": "", "vs_fused_prunadag": "",
                     "conv2d_ms": t_conv * 1e3, "ratio": t_fb / t_conv,
                     "fwd_ms (FB / conv)": f"{t_fb_fwd * 1e3:.3f} / {t_conv_fwd * 1e3:.3f}"})
    return rows


def run(quick: bool = False, threads: int = 2, out=None) -> str:
    """The CUDA benchmarks (``BenchmarkSkipped`` without a CUDA device or
    without prunopt's CUDA kernels); writes ``gpu.json``/``gpu.md`` into ``out``."""
    import prunopt

    if not torch.cuda.is_available():
        raise BenchmarkSkipped("no CUDA device")
    if not prunopt.cuda_kernels_available():
        raise BenchmarkSkipped("prunopt was built without its CUDA kernels")
    env = environment(threads)
    total, min_time = (1_000_000, 0.3) if quick else (10_000_000, 1.0)
    shapes = sorted(set(VGG16_CIFAR), key=VGG16_CIFAR.index)
    rows = _prunadag_rows(total, min_time) + _fb_rows(shapes[:4] if quick else shapes, 0.2 if quick else 0.5)
    return write_results("gpu", rows, env, out_dir=out,
                         notes=f"CUDA: prunAdag ({total // 1_000_000}M float32, version 3, relevant 0.1, global) and "
                               "FB training (VGG16-CIFAR layers, batch 32, 50% mask). Medians in ms.",
                         columns=["case", "contender", "median_ms", "vs_adagrad", "vs_fused_prunadag",
                                  "conv2d_ms", "ratio", "fwd_ms (FB / conv)"])


def main(out=None, quick: bool = False):
    """``python -m prunopt.bench.bench_gpu``: :func:`run` with torch's thread count."""
    return run(quick=quick, threads=torch.get_num_threads(), out=out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    try:
        print(main(a.out, a.quick))
    except BenchmarkSkipped as e:
        print(f"bench_gpu: skipped: {e}")
