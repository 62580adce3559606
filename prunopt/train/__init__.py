"""The example training job behind ``prunopt train``: an embedded dataset
(scikit-learn's digits, no download), a small CNN, the :class:`Job` every
method trains through (torchrun data parallelism, checkpoints, exact resume;
:mod:`prunopt.train.job`), the run directory (:mod:`prunopt.train.output`) and
one registered entry per pruning method."""
from prunopt.train.data import Dataset, load_digits
from prunopt.train.job import Job
from prunopt.train.loop import Summary, evaluate, iterate_minibatches, train_epoch
from prunopt.train.methods import METHODS, register_method
from prunopt.train.models import SmallCNN

__all__ = [
    "Dataset",
    "Job",
    "load_digits",
    "Summary",
    "evaluate",
    "iterate_minibatches",
    "train_epoch",
    "METHODS",
    "register_method",
    "SmallCNN",
]
