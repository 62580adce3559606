"""Shared helpers of the examples: the --tiny flag and a small synthetic dataset."""
import argparse
import os

import torch


def parse(description):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tiny", action="store_true", default=os.environ.get("PRUNOPT_EXAMPLES_TINY") == "1",
                        help="a seconds-long run (also PRUNOPT_EXAMPLES_TINY=1)")
    return parser.parse_args()


def data(n=256, shape=(1, 8, 8), classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y
