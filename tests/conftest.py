import os

import torch
from hypothesis import HealthCheck, settings

import prunopt

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_report_header(config):
    return (
        f"prunopt {prunopt.__version__}: extension={prunopt.extension_available()} "
        f"cuda_kernels={prunopt.cuda_kernels_available()} torch={torch.__version__}"
    )


def _flag(name):
    return os.environ.get(name, "0") not in ("", "0")


def missing_test_extras():
    """The modules of the package's ``[test]`` extra that the model-zoo tests
    skip without, and that do not import here (with the reason)."""
    import importlib

    missing = []
    for name in ("transformers", "accelerate"):
        try:
            importlib.import_module(name)
        except Exception as e:  # an ImportError, or a broken install failing at import
            missing.append(f"{name} ({type(e).__name__}: {e})")
    return missing


def pytest_sessionstart(session):
    if _flag("PRUNOPT_REQUIRE_EXTENSION") and not prunopt.extension_available():
        raise RuntimeError("PRUNOPT_REQUIRE_EXTENSION is set but prunopt._C is not loaded")
    if _flag("PRUNOPT_REQUIRE_TEST_EXTRAS"):
        missing = missing_test_extras()
        if missing:  # CI installed ".[test]": the zoo tests must run, not skip
            raise RuntimeError("PRUNOPT_REQUIRE_TEST_EXTRAS is set but the test extra is not importable: "
                               + "; ".join(missing))
