import math

import numpy as np
import pytest
import torch

from prunopt.schedules import DensitySchedule, TemperatureSchedule


def test_density_schedule_boundaries_linear():
    s = DensitySchedule(0.1, start=10, end=110)
    assert s(0) == 1.0 and s(9) == 1.0
    assert s(10) == pytest.approx(1.0)  # start of the annealing: full density
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s(110) == pytest.approx(0.1)
    assert s(111) == 0.1 and s(10**9) == 0.1
    assert s.budget(60, 200) == pytest.approx(200 * s(60))


def test_density_schedule_power_and_monotone():
    s = DensitySchedule(0.25, start=0, end=100, power=3)
    assert s(50) == pytest.approx(0.25 + 0.75 * 0.5**3)
    vals = [s(i) for i in range(0, 120)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert DensitySchedule.from_acceleration(4, 0, 10)(10) == pytest.approx(0.25)
    assert s(torch.tensor(50)) == s(50)


def test_density_schedule_state_dict_roundtrip():
    s = DensitySchedule(0.2, 5, 50, power=2)
    t = DensitySchedule(1.0, 0, 1)
    t.load_state_dict(s.state_dict())
    assert [t(i) for i in range(60)] == [s(i) for i in range(60)]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(target=0.0, start=0, end=1), ValueError, "target"),
        (dict(target=1.5, start=0, end=1), ValueError, "target"),
        (dict(target=0.5, start=-1, end=1), ValueError, "start"),
        (dict(target=0.5, start=5, end=5), ValueError, "end"),
        (dict(target=0.5, start=0, end=5, power=0), ValueError, "power"),
        (dict(target=0.5, start=0.5, end=5), TypeError, "start"),
        (dict(target="a", start=0, end=5), TypeError, "target"),
    ],
)
def test_density_schedule_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DensitySchedule(**kwargs)


def test_density_schedule_bad_step():
    s = DensitySchedule(0.5, 0, 10)
    with pytest.raises(ValueError, match="step"):
        s(-1)
    with pytest.raises(TypeError, match="step"):
        s(1.5)
    with pytest.raises(ValueError, match="alpha"):
        DensitySchedule.from_acceleration(0.5, 0, 10)


def test_tensor_steps_get_the_same_checks():
    d = DensitySchedule(0.25, 10, 20)
    t = TemperatureSchedule(1.0, 0.1, 10)
    # integral tensors of any dtype (torch.optim keeps state["step"] as a float tensor)
    assert d(torch.tensor(15)) == d(15) == d(torch.tensor(15.0)) == d(np.int64(15))
    assert t(torch.tensor(5.0, dtype=torch.float64)) == t(5)
    for bad in (torch.tensor(-3), torch.tensor(-3.0)):  # used to extrapolate
        with pytest.raises(ValueError, match="step"):
            t(bad)
        with pytest.raises(ValueError, match="step"):
            d(bad)
    for bad in (torch.tensor(15.7), torch.tensor(float("nan")), torch.tensor(float("inf"))):  # 15.7 was truncated
        with pytest.raises(ValueError, match="step"):
            d(bad)
    for bad in (torch.tensor(True), torch.tensor([1, 2]), torch.tensor(1 + 0j)):
        with pytest.raises(TypeError, match="step"):
            d(bad)


def test_temperature_schedule():
    s = TemperatureSchedule(1.0, 0.01, 100)
    assert s(0) == 1.0 and s(100) == pytest.approx(0.01) and s(1000) == pytest.approx(0.01)
    assert s(50) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="end"):
        TemperatureSchedule(1.0, 0.0, 10)
    with pytest.raises(ValueError, match="steps"):
        TemperatureSchedule(1.0, 0.1, 0)
