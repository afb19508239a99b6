"""Checked reads of a checkpoint's JSON files and their fields.

Each reader returns the field's value, or its default when the field is absent or null,
and raises a ValueError naming the file (`where`) and the field for anything else, so a
bad config.json fails before any weight is read. model_config.py, rope_config.py and the
family files read every field through these.
"""

from __future__ import annotations

import json
import math

REQUIRED = object()  # read_int's default for a field that must be present


def read_json_object(path: str) -> dict:
    """A JSON file that must hold an object; every failure is a ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); is the file truncated?"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not valid JSON (the file is not UTF-8 text)") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got a JSON {type(raw).__name__}")
    return raw


INT_MAX = 2**31 - 1  # no size or count of a checkpoint's config is larger: past it a field is a mistake


def read_int(where: str, raw: dict, key: str, default=REQUIRED, minimum: int = 1) -> int:
    """raw[key] as an int >= minimum and <= INT_MAX (an integral float such as 64.0 is accepted); null means
    absent."""
    value = raw.get(key)
    if value is None:
        if default is REQUIRED:
            raise ValueError(f"{where}: {key} is missing")
        return default
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    ):
        raise ValueError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    if value > INT_MAX:
        raise ValueError(f"{where}: {key} must be at most {INT_MAX}, got {value!r}")
    return int(value)


def read_float(where: str, raw: dict, key: str, default: float, positive: bool = True) -> float:
    """raw[key] as a finite float, > 0 (positive) or >= 0; null means absent."""
    value = raw.get(key)
    if value is None:
        return float(default)
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be a finite number {bound}, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{where}: {key} must be a finite number {bound}, got {value!r}")
    return float(value)


def read_optional_positive(where: str, raw: dict, key: str) -> float | None:
    """raw[key] as a finite float > 0, or None when absent or null."""
    return None if raw.get(key) is None else read_float(where, raw, key, 1.0)


def read_bool(where: str, raw: dict, key: str, default: bool = False) -> bool:
    """raw[key] as true or false; null means absent."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    return value
