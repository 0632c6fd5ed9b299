"""Small checks shared by every config: each raises a TypeError or ValueError naming the field."""
from __future__ import annotations

import math
import numbers
import os
from typing import Any

# Marks a setting accepted whatever its value (a vLLM option with no effect here).
ANY = object()


def is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def check_int(value: Any, name: str, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_bool(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def optional_bool(value: Any, name: str) -> bool | None:
    if value is not None:
        check_bool(value, name)
    return value


def check_optional_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a string (a branch, tag or commit) or None, got {value!r}")
    return value


def path_or_id(value: Any, name: str) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a Hugging Face Hub id or a local directory path, got {value!r}")
    return value


def check_memory_fraction(value: Any) -> None:
    if not is_number(value) or not math.isfinite(value):
        raise TypeError(f"gpu_memory_utilization must be a number in (0, 1], got {value!r}")
    if not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1] (the fraction of device memory "
                         f"specjax may use), got {value}")
