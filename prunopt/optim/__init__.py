"""Optimizers and projections: ``BudgetProjection`` (ProM/ProbMask),
``PrunAdag`` and the Frank-Wolfe baselines (prunAdag paper)."""
from prunopt.optim.budget import BudgetProjection

__all__ = ["BudgetProjection"]


# --- prunAdag (Porcelli et al.) ---
from prunopt.optim.prunadag import PrunAdag  # noqa: E402  (functional form: prunopt.optim.prunadag.prunadag)

__all__ += ["PrunAdag"]
from prunopt.optim.sfw import SFW  # noqa: E402

__all__ += ["SFW"]
