"""`eqx_lean._arguments`: the one check of scalar arguments and config fields."""

import math

import numpy as np
import pytest

from eqx_lean.internal import check_boolean, check_integer, check_number, check_optional_integer


def test_integer_returns_a_python_int_and_refuses_bools_floats_and_strings():
    assert check_integer(np.int64(3), "`n`", minimum=1) == 3
    assert type(check_integer(np.int64(3), "`n`")) is int
    for bad in (True, np.bool_(False), 2.0, "2", None):
        with pytest.raises(TypeError, match=r"`n` must be an integer of at least 1; got"):
            check_integer(bad, "`n`", minimum=1)


def test_integer_names_its_range():
    with pytest.raises(ValueError, match=r"`k` in c.json must be an integer from 0 to 9; got 10\."):
        check_integer(10, "`k` in c.json", minimum=0, maximum=9)
    with pytest.raises(ValueError, match=r"of at most 9; got 10"):
        check_integer(10, "`k`", maximum=9)


def test_number_refuses_strings_bools_and_non_finite_values():
    assert check_number(1, "`eps`", above=0) == 1.0
    for bad in ("1e-6", True, None):
        with pytest.raises(TypeError, match=r"`eps` must be a finite number above 0; got"):
            check_number(bad, "`eps`", above=0)
    for bad in (math.nan, math.inf, -1.0, 0.0):
        with pytest.raises(ValueError, match=r"`eps` must be a finite number above 0; got"):
            check_number(bad, "`eps`", above=0)
    # JSON reads a long integer literal as an `int` no float holds: refused, not an
    # OverflowError.
    with pytest.raises(
        ValueError, match=r"`eps` must be a finite number above 0; got an integer of 401 digits\."
    ):
        check_number(10**400, "`eps`", above=0)


def test_number_bounds():
    assert check_number(1.0, "`p`", minimum=0, maximum=1) == 1.0
    with pytest.raises(ValueError, match=r"at least 0 and at most 1; got 1\.5"):
        check_number(1.5, "`p`", minimum=0, maximum=1)
    with pytest.raises(ValueError, match=r"above 0 and below 1; got 1\.0"):
        check_number(1.0, "`f`", above=0, below=1)


def test_boolean_refuses_strings_and_integers():
    assert check_boolean(np.bool_(True), "`tie`") is True
    for bad in ("false", 0, 1, None):
        with pytest.raises(TypeError, match=r"`tie` must be true or false; got"):
            check_boolean(bad, "`tie`")


def test_optional_integer():
    assert check_optional_integer(None, "`w`", minimum=1) is None
    with pytest.raises(TypeError, match=r"`w` must be None or an integer of at least 1; got True"):
        check_optional_integer(True, "`w`", minimum=1)
    with pytest.raises(ValueError, match=r"`w` must be None or an integer of at least 1; got 0\."):
        check_optional_integer(0, "`w`", minimum=1)
