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


# --- audit fixes: argument handling ---------------------------------------------------------------


def test_huge_numbers_are_value_errors():
    for call, name in [(lambda: DensitySchedule.from_acceleration(10**400, 0, 10), "alpha"),
                       (lambda: DensitySchedule(10**400, 0, 10), "target"),
                       (lambda: DensitySchedule(0.5, 0, 10, power=10**400), "power"),
                       (lambda: DensitySchedule(0.5, 0, 10).budget(3, 10**400), "total"),
                       (lambda: TemperatureSchedule(10**400, 0.1, 10), "start")]:
        with pytest.raises(ValueError, match=name):  # were OverflowError
            call()


def test_numpy_integers_and_numbers_are_accepted_everywhere():
    s = DensitySchedule(np.float32(0.25), np.int64(10), np.int64(20), power=np.int64(3))
    assert s.start == 10 and type(s.start) is int and s.power == 3.0
    assert [s(i) for i in range(25)] == [DensitySchedule(0.25, 10, 20, power=3)(i) for i in range(25)]
    assert TemperatureSchedule(1.0, 0.1, np.int64(10))(5) == TemperatureSchedule(1.0, 0.1, 10)(5)


@pytest.mark.parametrize("power", [True, "3", None, [3]])
def test_power_of_the_wrong_type_is_a_type_error(power):
    with pytest.raises(TypeError, match="power"):
        DensitySchedule(0.5, 0, 10, power=power)


@pytest.mark.parametrize("power", [0, -1, float("nan"), float("inf")])
def test_power_out_of_range_is_a_value_error(power):
    with pytest.raises(ValueError, match="power"):
        DensitySchedule(0.5, 0, 10, power=power)


def test_budget_checks_total():
    s = DensitySchedule(0.5, 0, 10)
    assert s.budget(5, 200) == pytest.approx(150.0) and s.budget(5, torch.tensor(200.0)) == pytest.approx(150.0)
    assert s.budget(5, 0) == 0.0
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="total"):
            s.budget(5, bad)
    for bad in ("200", True, None):
        with pytest.raises(TypeError, match="total"):
            s.budget(5, bad)


def test_load_state_dict_names_a_missing_key_and_changes_nothing():
    s = DensitySchedule(0.2, 5, 50, power=2)
    before = dict(s.__dict__)
    with pytest.raises(ValueError, match="end"):
        s.load_state_dict({"target": 0.5, "start": 1})  # was KeyError
    with pytest.raises(ValueError, match="target"):
        s.load_state_dict({"target": 5.0, "start": 1, "end": 3})
    with pytest.raises(TypeError, match="state"):
        s.load_state_dict([0.5, 1, 3])
    assert s.__dict__ == before
    s.load_state_dict({"target": 0.5, "start": 1, "end": 3})  # an old state without power: linear
    assert s.power == 1.0 and s.end == 3
    t = TemperatureSchedule(1.0, 0.1, 10)
    with pytest.raises(ValueError, match="steps"):
        t.load_state_dict({"start": 2.0, "end": 0.5})
    assert (t.start, t.end, t.steps) == (1.0, 0.1, 10)
