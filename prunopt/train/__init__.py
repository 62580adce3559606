"""The example training job behind ``prunopt train``: an embedded dataset
(scikit-learn's digits, no download), a small CNN, a training loop with a
progress bar, and one registered entry per pruning method."""
from prunopt.train.data import Dataset, load_digits
from prunopt.train.loop import Summary, evaluate, iterate_minibatches, train_epoch
from prunopt.train.methods import METHODS, register_method
from prunopt.train.models import SmallCNN

__all__ = [
    "Dataset",
    "load_digits",
    "Summary",
    "evaluate",
    "iterate_minibatches",
    "train_epoch",
    "METHODS",
    "register_method",
    "SmallCNN",
]
