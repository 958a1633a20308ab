import math

import pytest

from d2lgpu.checks import check_positive_float, check_positive_int, check_seed


@pytest.mark.parametrize("value", [1, 7, 2**40])
def test_positive_ints_pass_through(value):
    assert check_positive_int("n", value) == value


@pytest.mark.parametrize("value", [0, -3, 1.0, "2", None, True])
def test_everything_else_is_refused_with_the_name(value):
    with pytest.raises(ValueError, match=r"^batch_size must be a positive int, got "):
        check_positive_int("batch_size", value)


@pytest.mark.parametrize("value", [0, 5, 2**64 - 1])
def test_seeds_torch_takes_pass_through(value):
    assert check_seed(value) == value


@pytest.mark.parametrize("value", [-1, 2**64, 1.0, "3", True])
def test_other_seeds_are_refused_with_the_range(value):
    with pytest.raises(ValueError, match=r"seed must be an int from 0 to 2\*\*64 - 1"):
        check_seed(value)


@pytest.mark.parametrize("value", [1, 0.5, 1e-12, 300.0])
def test_positive_finite_numbers_pass_as_floats(value):
    result = check_positive_float("lr", value)
    assert result == value and isinstance(result, float)


@pytest.mark.parametrize("value", [0, -0.1, math.nan, math.inf, -math.inf, "0.1", None, True])
def test_everything_else_is_refused_as_a_positive_finite_number(value):
    with pytest.raises(ValueError, match=r"^lr must be a positive finite number, got "):
        check_positive_float("lr", value)
