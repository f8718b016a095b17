"""One validation of scalar arguments and config fields, so that every function says the same
thing of the same mistake: a sentence naming the argument or field (and its file, when it came
from one), what it must be, and what it was.

Each check returns the value in its canonical Python type (an `int`, a `float`, a `bool`), so a
caller can write `size = arguments.integer(size, "`size`", minimum=1)` and use `size` after.
`what` is the name as the message should show it: "`max_new_tokens`", or
"`rms_norm_eps` in /path/config.json".

Bools are not integers and not numbers here (`True` as a block size of 1 is a bug in the
caller, not a request), and NumPy scalars count as their Python kinds.
"""

import math
from typing import Any

import numpy as np


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool | np.bool_)


def _bounds(minimum: Any, maximum: Any) -> str:
    if minimum is not None and maximum is not None:
        return f" from {minimum} to {maximum}"
    if minimum is not None:
        return f" of at least {minimum}"
    if maximum is not None:
        return f" of at most {maximum}"
    return ""


def integer(
    value: Any, what: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """Returns `value` as an `int`; refuses a bool, a float (even `2.0`), anything else that is
    not an integer, and an integer outside `[minimum, maximum]`.

    **Raises:** `TypeError` for the wrong kind, `ValueError` for the wrong size.
    """
    wanted = f"{what} must be an integer{_bounds(minimum, maximum)}"
    if _is_bool(value) or not isinstance(value, int | np.integer):
        raise TypeError(f"{wanted}; got {value!r} ({type(value).__name__}).")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{wanted}; got {value}.")
    return value


def number(
    value: Any,
    what: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    below: float | None = None,
) -> float:
    """Returns `value` as a finite `float`; refuses a bool, a string (even `"1e-6"`), NaN, an
    infinity, and a number outside `[minimum, maximum]` or not strictly above `above` or below
    `below`.

    **Raises:** `TypeError` for the wrong kind, `ValueError` for a non-finite or out-of-range
    value.
    """
    parts = []
    if above is not None:
        parts.append(f"above {above}")
    if minimum is not None:
        parts.append(f"at least {minimum}")
    if below is not None:
        parts.append(f"below {below}")
    if maximum is not None:
        parts.append(f"at most {maximum}")
    wanted = f"{what} must be a finite number" + (f" {' and '.join(parts)}" if parts else "")
    if _is_bool(value) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{wanted}; got {value!r} ({type(value).__name__}).")
    try:
        value = float(value)
    except OverflowError:  # an integer beyond every float (a JSON literal of 400 digits)
        raise ValueError(f"{wanted}; got an integer of {len(str(abs(value)))} digits.") from None
    if (
        not math.isfinite(value)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
        or (above is not None and value <= above)
        or (below is not None and value >= below)
    ):
        raise ValueError(f"{wanted}; got {value!r}.")
    return value


def boolean(value: Any, what: str) -> bool:
    """Returns `value` as a `bool`; refuses anything else (a string `"false"` is truthy, and the
    integer 0 is more likely a mistaken field than a switch).

    **Raises:** `TypeError`.
    """
    if not _is_bool(value):
        raise TypeError(f"{what} must be true or false; got {value!r} ({type(value).__name__}).")
    return bool(value)


def optional_integer(
    value: Any, what: str, *, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    """`None`, or `integer(value, ...)`."""
    if value is None:
        return None
    try:
        return integer(value, what, minimum=minimum, maximum=maximum)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace(f"{what} must be", f"{what} must be None or", 1)) from None
