"""Optimizers and projections: ``BudgetProjection`` (ProM/ProbMask),
``PrunAdag`` and the Frank-Wolfe baselines (prunAdag paper)."""
__all__ = []
