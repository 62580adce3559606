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


def pytest_sessionstart(session):
    if os.environ.get("PRUNOPT_REQUIRE_EXTENSION", "0") not in ("", "0") and not prunopt.extension_available():
        raise RuntimeError("PRUNOPT_REQUIRE_EXTENSION is set but prunopt._C is not loaded")
