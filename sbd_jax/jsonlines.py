"""One JSON rule for every file the project reads (training data, prompt files, model and adapter configs): a line
or file is a JSON object, and a bad one is an error naming where it is (file and line) and what is wrong."""
from __future__ import annotations

import json
from pathlib import Path


def parse_object(line: str, where: str, error: type[Exception] = ValueError) -> dict:
    """`line` as a JSON object, or `error(f"{where}: ...")` saying why not."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # json's C parser recurses once per nesting level
        raise error(f"{where}: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise error(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_object(path: Path, error: type[Exception] = ValueError) -> dict:
    """The JSON object in file `path`, or `error` naming the file and why not (bad UTF-8, bad JSON, nesting too deep,
    not an object)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{str(path)!r} is not UTF-8 text (byte {e.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{str(path)!r} is not valid JSON: {e}") from None
    except RecursionError:
        raise error(f"{str(path)!r}: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise error(f"{str(path)!r} must hold a JSON object, not {type(obj).__name__}")
    return obj
