"""argparse ``type=`` functions shared by the ``prunopt`` command and the
training methods' options: each turns a string into a checked value or raises
``argparse.ArgumentTypeError`` naming the option (a usage error, exit 2)."""
from __future__ import annotations

import argparse
import math


def _number(text: str, name: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}")
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{name} must be {what}, got {v}")
    return v


def fraction_arg(name: str):
    """argparse ``type=`` for a number in [0, 1] (the option's ``name`` is in the message)."""
    def parse(text):
        v = _number(text, name, "a number in [0, 1]")
        if not 0.0 <= v <= 1.0:
            raise argparse.ArgumentTypeError(f"{name} must be in [0, 1], got {v}")
        return v

    return parse


def open_fraction_arg(name: str):
    """argparse ``type=`` for a number in (0, 1] (a fraction that must keep something)."""
    def parse(text):
        v = _number(text, name, "a number in (0, 1]")
        if not 0.0 < v <= 1.0:
            raise argparse.ArgumentTypeError(f"{name} must be in (0, 1], got {v}")
        return v

    return parse


def fractions_arg(name: str):
    """argparse ``type=`` for a comma-separated, non-empty list of numbers in [0, 1]."""
    one = fraction_arg(name)

    def parse(text):
        values = [one(v.strip()) for v in str(text).split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{name} must list at least one number in [0, 1], got {text!r}")
        return values

    return parse


def _bounded_float_arg(name: str, strict: bool):
    what = "a finite number > 0" if strict else "a finite number >= 0"

    def parse(text):
        v = _number(text, name, what)
        if not (v > 0 if strict else v >= 0):
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {v}")
        return v

    return parse


def positive_float_arg(name: str):
    """argparse ``type=`` for a finite number > 0 (learning rates, temperatures, exponents)."""
    return _bounded_float_arg(name, strict=True)


def nonnegative_float_arg(name: str):
    """argparse ``type=`` for a finite number >= 0 (regularisation strengths)."""
    return _bounded_float_arg(name, strict=False)


def int_arg(name: str, minimum: int):
    """argparse ``type=`` for an integer >= ``minimum``."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {minimum}, got {text!r}")
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {minimum}, got {v}")
        return v

    return parse


def positive_int_arg(name: str):
    """argparse ``type=`` for an integer >= 1."""
    return int_arg(name, 1)
