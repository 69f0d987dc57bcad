"""Prompt files and the streamed, resumable output file of decode.py.

Input: JSON lines, one object per prompt:
  {"id": ..., "prompt": "text"}              text, tokenized with the model dir's tokenizer.json
  {"id": ..., "prompt_ids": [1, 2, 3]}       token ids as is
  {"id": ..., "messages": [{"role": "user", "content": "..."}]}   chat: the tokenizer's chat template
  {"id": ..., "prompt": "text", "chat": true}                    text as one user message (or --chat)
"id" is optional (default: the line number) and must be unique; "max_new_tokens" (optional) caps this
prompt's output below the run's --max-new-tokens. Blank lines are skipped.

Output: one JSON object per completed prompt, written with a single write + flush, so a killed run
leaves at most one partial last line; `open_output(resume=True)` cuts that partial line off and
returns the ids already written, which are then skipped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..io.tokenizer import Tokenizer, TokenizerError
from ..jsonlines import parse_object
from .checks import ids_in_vocab
from .spec import DecodeError


class PromptFileError(DecodeError):
    """An input or output file that cannot be used as asked (names the file and line)."""


@dataclass(frozen=True)
class Prompt:
    id: object
    line: int
    ids: tuple[int, ...]
    max_new_tokens: int | None = None  # this prompt's own cap (None: the run's)


def read_prompts(path, tokenizer: Tokenizer | None, *, chat: bool = False, vocab_size: int | None = None
                 ) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"input file {str(path)!r} does not exist")
    prompts, seen = [], {}
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}: line {n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PromptFileError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            row = parse_object(line, where, PromptFileError)
            pid = row.get("id", n)
            if isinstance(pid, (dict, list)) or pid is None:
                raise PromptFileError(f"{where}: 'id' must be a string or a number")
            if pid in seen:
                raise PromptFileError(f"{where}: duplicate id {pid!r} (first on line {seen[pid]})")
            seen[pid] = n
            ids = row_ids(row, tokenizer, chat, where, vocab_size)
            cap = row.get("max_new_tokens")
            if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
                raise PromptFileError(f"{where}: 'max_new_tokens' must be an integer >= 1, got {cap!r}")
            prompts.append(Prompt(pid, n, tuple(ids), cap))
    if not prompts:
        raise PromptFileError(f"input file {str(path)!r} holds no prompts (empty)")
    return prompts


def row_ids(row: dict, tokenizer: Tokenizer | None, chat: bool, where: str, vocab_size: int | None = None) -> list[int]:
    """The prompt ids of one input row ({"prompt"}, {"prompt_ids"} or {"messages"}); a row that gives no ids, or
    ids outside [0, vocab_size), is an error naming `where`."""
    ids = _row_ids(row, tokenizer, chat, where)
    if not ids:
        raise PromptFileError(f"{where}: the prompt is empty (0 tokens)")
    if vocab_size is not None and not ids_in_vocab(ids, vocab_size):
        raise PromptFileError(f"{where}: token ids must be in [0, {vocab_size})")
    return ids


def _row_ids(row: dict, tokenizer: Tokenizer | None, chat: bool, where: str) -> list[int]:
    kinds = [k for k in ("prompt", "prompt_ids", "messages") if k in row]
    if len(kinds) != 1:
        raise PromptFileError(f"{where}: needs exactly one of 'prompt' (text), 'prompt_ids' or 'messages', "
                              f"got keys {sorted(row)}")
    kind = kinds[0]
    if kind == "prompt_ids":
        ids = row["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise PromptFileError(f"{where}: 'prompt_ids' must be a list of integers")
        return ids
    if tokenizer is None:
        raise PromptFileError(f"{where}: a text prompt needs tokenizer.json in the model directory "
                              "(or give 'prompt_ids')")
    try:
        if kind == "messages":
            msgs = row["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in msgs):
                raise PromptFileError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects")
            check_messages(msgs, where)
            return tokenizer.apply_chat_template(msgs)
        if not isinstance(row["prompt"], str):
            raise PromptFileError(f"{where}: 'prompt' must be a string")
        if chat or row.get("chat") is True:
            return tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}])
        return tokenizer.encode(row["prompt"])
    except TokenizerError as e:
        raise PromptFileError(f"{where}: {e}") from None


def check_messages(msgs: list[dict], where: str) -> None:
    """Each message's role and content are strings (a number would reach the template, which may fail on it)."""
    for j, m in enumerate(msgs):
        for key in ("role", "content"):
            if not isinstance(m[key], str):
                raise PromptFileError(f"{where}: message {j} {key!r} must be a string, got "
                                      f"{type(m[key]).__name__} {m[key]!r}")


def open_output(path, *, resume: bool, overwrite: bool) -> tuple[set, object]:
    """Open the output for appending. Returns (ids already written, file). With `resume`, a trailing
    partial line (a killed write) is cut off; without `resume` or `overwrite` an existing non-empty
    file is an error (nothing is ever silently overwritten). A directory, or a path under a regular file,
    is an error naming the path."""
    path = Path(path)
    done: set = set()
    if path.is_dir():
        raise PromptFileError(f"output {str(path)!r} is a directory: --output takes a file path")
    blocker = next((a for a in path.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise PromptFileError(f"output {str(path)!r} cannot be written: {str(blocker)!r} is a regular file, not a "
                              "directory")
    if path.exists() and path.stat().st_size and not (resume or overwrite):
        raise PromptFileError(f"output {str(path)!r} exists: pass --resume to continue it or --overwrite")
    if path.exists() and resume:
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1  # everything after the last newline is a partial line
        if end < len(data):
            with path.open("r+b") as f:
                f.truncate(end)
        for n, line in enumerate(data[:end].decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                done.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise PromptFileError(f"{path}: line {n} is not a result line; cannot resume from this file") from None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.open("w" if overwrite and not resume else "a", encoding="utf-8")
    except OSError as e:
        raise PromptFileError(f"output {str(path)!r} cannot be written: {e.strerror or e}") from None
    return done, f


def check_output_settings(path, settings: dict, *, resume: bool, allowed=(), prompts=(), done=()) -> None:
    """The settings an output file is made with live next to it (`<output>.settings.json`, see resume.py: the
    model's file fingerprint, a hash of each prompt's content); `--resume` under other settings, with a changed
    model, or with a written row's id now naming other content is refused, naming each change unless `allowed`.
    An output with rows but no record is refused unless `allowed` holds "settings". Written (again) once checked."""
    from .resume import check_record, prompt_hashes
    side = Path(f"{path}.settings.json")
    record = {**settings, "prompt_hashes": prompt_hashes(prompts)}
    if resume:
        check_record(path, side, record, allowed=tuple(allowed), done=done, prompts=prompts)
    try:
        side.parent.mkdir(parents=True, exist_ok=True)
        side.write_text(json.dumps(record, indent=2, default=str) + "\n")
    except OSError as e:
        raise PromptFileError(f"cannot write {str(side)!r}: {e.strerror or e}") from None


def write_row(f, row: dict) -> None:
    """One complete line per write, flushed before returning (a kill mid-line is cut off on resume); a failed write
    (a full disk) is an error naming the output."""
    try:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
    except OSError as e:
        raise PromptFileError(f"cannot write to the output {f.name!r}: {e.strerror or e}; the rows written before "
                              "are complete (--resume continues once there is room)") from None
