import pytest

from d2lgpu.checks import check_positive_int


@pytest.mark.parametrize("value", [1, 7, 2**40])
def test_positive_ints_pass_through(value):
    assert check_positive_int("n", value) == value


@pytest.mark.parametrize("value", [0, -3, 1.0, "2", None, True])
def test_everything_else_is_refused_with_the_name(value):
    with pytest.raises(ValueError, match=r"^batch_size must be a positive int, got "):
        check_positive_int("batch_size", value)
