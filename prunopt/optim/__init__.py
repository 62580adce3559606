"""Optimizers and projections: ``BudgetProjection`` (ProM/ProbMask),
``PrunAdag`` and the Frank-Wolfe baselines (prunAdag paper)."""
from prunopt.optim.budget import BudgetProjection

__all__ = ["BudgetProjection"]
