"""decode.py's resume record (`<output>.settings.json`): what the written rows depend on, checked by `--resume`.
Besides the decoding settings it holds a fingerprint of the model's files (config.json by content, each weight
file by size and modification time: cheap, nothing is read) and a hash of every prompt's content (its token ids
and cap), so a changed model, or a prompt id that now names other content (a line inserted above prompts keyed
by line number), is refused, naming what changed. `--allow-change KEY` accepts one on purpose: a settings key,
`model_files` (the fingerprint), `prompts` (the content hashes) or `settings` (an output whose record is gone).
`lock_output` keeps a second writer off the output and its record while one writes them (`<output>.lock`)."""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from .spec import DecodeError

CONTENT_FILES = ("config.json", "adapter_config.json", "model.safetensors.index.json")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.npz")


class ResumeError(DecodeError):
    """`--resume` of an output whose rows were made from another model, other prompts or unknown settings."""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def model_fingerprint(model_dir) -> dict:
    """{file name: fingerprint} of a model (or adapter) directory: config files by a hash of their content,
    weight files by size and modification time (a rewritten checkpoint changes both or the time)."""
    d = Path(model_dir)
    out = {name: "sha256 " + _digest((d / name).read_bytes()) for name in CONTENT_FILES if (d / name).is_file()}
    for pattern in WEIGHT_PATTERNS:
        for f in sorted(d.glob(pattern)):
            st = f.stat()
            out[f.name] = f"{st.st_size} bytes, modified {st.st_mtime_ns}"
    return out


def prompt_hash(p) -> str:
    """A `Prompt`'s content: its token ids and its own max_new_tokens."""
    return _digest(json.dumps([list(p.ids), p.max_new_tokens]).encode())


def prompt_hashes(prompts) -> list:
    """[[id, hash], ...] (a list: ids 3 and "3" stay apart in JSON)."""
    return [[p.id, prompt_hash(p)] for p in prompts]


def _keyed(pairs) -> dict:
    return {json.dumps(i): h for i, h in pairs or ()}


def check_record(path, side: Path, record: dict, *, allowed: tuple, done, prompts=()) -> None:
    """`record` (settings + "prompt_hashes") against the saved one at `side`, for resuming `path` with rows
    `done`; raises ResumeError naming each change not `allowed`."""
    if not side.is_file():
        if done and "settings" not in allowed:
            raise ResumeError(f"{path} holds {len(done)} row(s) but its settings record {str(side)!r} is missing: "
                              "the model, prompts and settings they were made with are unknown; resume anyway with "
                              "--allow-change settings, or write to another --output")
        return
    try:
        saved = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        if "settings" in allowed:
            return
        raise ResumeError(f"cannot read the settings record {str(side)!r}: not valid JSON ({e}); resume anyway "
                          "with --allow-change settings (it is rewritten)") from None
    _check_settings(path, saved, record, allowed)
    if "prompts" not in allowed:
        _check_prompts(path, saved.get("prompt_hashes"), record["prompt_hashes"], done, prompts)


def _check_settings(path, saved: dict, record: dict, allowed: tuple) -> None:
    from ..config import changed_settings
    neutral = ("prompt_hashes",) + allowed + tuple(a + "." for a in allowed)
    diff = changed_settings({k: v for k, v in saved.items() if k != "prompt_hashes"},
                            {k: v for k, v in record.items() if k != "prompt_hashes"}, neutral)
    model = [d for d in diff if d.startswith(("model_files.", "adapter_files."))]
    if model and "model_files" not in saved:
        raise ResumeError(f"{path}: its settings record holds no fingerprint of the model's files (written by an "
                          "older decode.py), so the model cannot be checked: resume with --allow-change model_files "
                          "if it is the same model")
    if model:
        raise ResumeError(f"{path} was written by another model: its files changed ({'; '.join(model)}); resume "
                          "with the model it was made with, accept the change on purpose with --allow-change "
                          "model_files, or write to another --output")
    if diff:
        raise ResumeError(f"{path} was written with other settings ({'; '.join(diff)}): resume with the same ones, "
                          "accept a change on purpose with --allow-change KEY, or write to another --output")


def _check_prompts(path, old_pairs, new_pairs, done, prompts) -> None:
    old, new = _keyed(old_pairs), _keyed(new_pairs)
    line = {json.dumps(p.id): p.line for p in prompts}
    changed = [i for i in done if json.dumps(i) in old and json.dumps(i) in new and old[json.dumps(i)] != new[json.dumps(i)]]
    if changed:
        changed.sort(key=lambda i: line.get(json.dumps(i), 0))
        named = ", ".join(f"{i!r} (input line {line.get(json.dumps(i), '?')})" for i in changed[:5])
        raise ResumeError(f"{path}: {len(changed)} written row(s) have an id that now names other prompt content: "
                          f"{named}{' ...' if len(changed) > 5 else ''} (a line inserted or edited? a line without "
                          "an 'id' is keyed by its line number); resume with the same input, give each line an "
                          "'id', accept on purpose with --allow-change prompts, or write to another --output")


def lock_output(path):
    """An exclusive lock (sbd_jax/runlock.py) on the output `path` and its settings record, held by the file
    `<output>.lock` beside the file the path names (symbolic links followed: two paths to one file share one lock):
    a second decode.py on the same output is refused naming the first. The output's directory is created for it, as
    `open_output` would."""
    from ..runlock import acquire
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # a file in the way: nothing can be written there, and open_output names it
        return contextlib.nullcontext()
    real = path.resolve()
    named = str(path) if real == path.absolute() else f"{str(path)} (-> {str(real)})"
    return acquire(f"{real}.lock", what=f"the decode output {named!r}")
