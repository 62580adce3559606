"""``python -m prunopt``: the ``prunopt`` command line (:func:`prunopt.cli.main`)."""
import sys

from prunopt.cli import main

if __name__ == "__main__":
    sys.exit(main())
