"""One JSON-lines rule for every file the project reads (training data, prompt files): a line is a JSON object,
and a bad one is an error naming where it is (file and line) and what is wrong."""
from __future__ import annotations

import json


def parse_object(line: str, where: str, error: type[Exception] = ValueError) -> dict:
    """`line` as a JSON object, or `error(f"{where}: ...")` saying why not."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise error(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj
