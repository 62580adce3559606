"""Shared by tools/profile_*_cuda.py: how long a CUDA step takes, seen from the
host. ``measure(step)`` returns the wall time of a synchronised step, the host
time to issue one (the device kept busy by a sleep kernel, so a step that
synchronises shows up as the sleep's length), the synchronising calls inside
one step (``torch.cuda.set_sync_debug_mode``) and a torch.profiler run of 10
steps."""
from __future__ import annotations

import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile


def measure(step, reps=50, sleep_cycles=int(1e9)):
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    host = (time.perf_counter() - t0) / 10
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    return wall, host, syncs, prof
