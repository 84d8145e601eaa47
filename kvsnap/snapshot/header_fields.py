"""The checks every kvsnap header field shares: JSON bounded before it is parsed, integers in
range (a JSON ``true`` is no count), a bad value shown short in the error. No mlx here."""

from __future__ import annotations

import json
import re

from kvsnap.snapshot.file import FormatError

# ASCII only: int() would also take " 7", "7_0" and other scripts' digits
DIGITS_RE = re.compile(r"[0-9]{1,12}")
MAX_COUNT = 2**53


def show(value: object) -> str:
    """A bad value as an error names it: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def json_field(meta: dict, field: str, limit: int) -> object:
    """A metadata field's JSON, its length bounded before it is parsed."""
    text = meta[field]
    if len(text) > limit:
        raise FormatError(f"{field} is {len(text)} characters, over the {limit} limit")
    try:
        return json.loads(text)
    except RecursionError:
        raise FormatError(f"{field} is nested too deeply") from None
    except ValueError as exc:
        raise FormatError(f"{field} is not valid JSON ({str(exc)[:120]})") from None


def check_count(field: str, value: object, low: int = 0, high: int = MAX_COUNT) -> int:
    """``value`` if it is an integer from ``low`` to ``high``; else a FormatError naming the
    field."""
    if type(value) is not int or not low <= value <= high:  # not bool: JSON true is no count
        raise FormatError(f"{field} is {show(value)}, expected an integer from {low} to {high}")
    return value
