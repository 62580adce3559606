"""Pruning toolkit: masks, scores, schedules and methods for standard and
interspace weights."""
__all__ = []
