"""One JSON rule for every file the project reads (training data, prompt files, model and adapter configs): a line
or file is a JSON object, and a bad one is an error naming where it is (file and line) and what is wrong."""
from __future__ import annotations

import json
import re
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
    if _SURROGATE.search(line):  # only a \u escape makes one: text read as UTF-8 cannot hold it
        _check_text(obj, where, error)
    return obj


_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_text(x, where: str, error: type[Exception], key: str = "") -> None:
    """Every string in `x` is text (a lone UTF-16 surrogate such as "\\ud800" is not: no tokenizer or file takes it)."""
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError as e:
            raise error(f"{where}: {key or 'a value'} holds a lone surrogate {x[e.start]!r} (not text)") from None
    elif isinstance(x, dict):
        for k, v in x.items():
            _check_text(k, where, error, "a key")
            _check_text(v, where, error, repr(k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _check_text(v, where, error, f"{key}[{i}]" if key else f"item {i}")


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
