"""Argument checks shared by configs: one message for one mistake."""
from __future__ import annotations

__all__ = ["check_positive_int", "check_positive_fields"]


def check_positive_int(name: str, value) -> int:
    """``value`` unchanged if it is an int >= 1 (bools refused), else a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")
    return value


def check_positive_fields(obj, names) -> None:
    """``check_positive_int`` on each named attribute of a (dataclass) config."""
    for name in names:
        check_positive_int(name, getattr(obj, name))
