"""The real-model demo's first stages: the base model (a GGUF converted once) and the data (the interpreter's stdlib
split by module, HumanEval). Each leaves its result in the output directory with the settings that made it; a rerun
reuses a finished stage and refuses one made with other settings (the toy demo's rules: demos.toy.stages)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sbd_jax.config import ConfigError
from ..toy.stages import check_stage_settings
from sbd_jax.io.tokenizer import Tokenizer
from .config import RealDemoConfig


def stage_base(cfg: RealDemoConfig, log=print) -> Path:
    """The base model's HF directory: the GGUF converted once (float32) into the model cache."""
    from .. import real_model
    from sbd_jax.io.gguf import cached_convert
    base = real_model.model_dir() if cfg.gguf is None else cached_convert(cfg.gguf)
    log(f"[base] {base}")
    return base


def _write_jsonl(path: Path, records) -> int:
    """tasks.write_jsonl written aside and renamed: a file that exists is whole."""
    from .tasks import write_jsonl
    tmp = path.with_name(f".{path.name}.tmp")
    n = write_jsonl(tmp, records)
    tmp.replace(path)
    return n


DATA_FILES = ("train", "heldout", "humaneval")
MANIFEST = "files.json"  # each data file's sha256, written when the stage finishes


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_manifest(root: Path, files: dict[str, Path]) -> None:
    """A reused data file is byte for byte what the stage wrote: a damaged or edited one (held-out lines lost) would
    change every number computed from it."""
    made = json.loads((root / MANIFEST).read_text())
    for name, f in files.items():
        if not f.is_file() or _digest(f) != made.get(name):
            raise ConfigError(f"{str(f)!r} is {'missing' if not f.is_file() else 'not what the data stage wrote'} "
                              f"(its sha256 is in {MANIFEST}): delete {str(root)!r} to remake the data")


def stage_data(cfg: RealDemoConfig, tok: Tokenizer | None, log=print) -> dict[str, Path]:
    """train.jsonl (SFT prompt/response pairs of the train modules), heldout.jsonl (held-out functions) and
    humaneval.jsonl, with the corpus fingerprint and the split's counts in data/corpus.json. With `data_dir`, that
    directory as made earlier (its settings must be this run's; no tokenizer needed)."""
    from . import corpus, tasks
    spec = {k: getattr(cfg, k) for k in ("seed", "prompt_tokens", "max_body_lines", "per_module", "n_heldout",
                                         "n_humaneval", "corpus_root")} | {"task_format": tasks.TASK_FORMAT}
    if cfg.data_dir is not None:
        return prepared_data(Path(cfg.data_dir), spec, log)
    root = Path(cfg.out_dir) / "data"
    files = {n: root / f"{n}.jsonl" for n in DATA_FILES}
    mods = corpus.load(cfg.corpus_root)
    spec["corpus_fingerprint"] = mods.fingerprint
    saved = root / "settings.json"
    if saved.exists():
        check_stage_settings(root, json.loads(saved.read_text()), spec)
        if (root / MANIFEST).is_file():  # written last: the stage finished
            check_manifest(root, files)
            log(f"[data] reusing {root}")
            return files
    root.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(spec))
    opts, encode = task_options(cfg), lambda text: tok.encode(text, add_special_tokens=False)
    n_train = _write_jsonl(files["train"], tasks.training_records(mods.train, opts, encode, cfg.prompt_tokens))
    n_held = _write_jsonl(files["heldout"], heldout_records(cfg, tok, mods))
    n_he = _write_jsonl(files["humaneval"], tasks.humaneval_records(encode, cfg.prompt_tokens, limit=cfg.n_humaneval))
    report = {**mods.summary(), "examples": {"train": n_train, "heldout": n_held, "humaneval": n_he}}
    (root / "corpus.json").write_text(json.dumps(report, indent=2))
    (root / MANIFEST).write_text(json.dumps({n: _digest(f) for n, f in files.items()}, indent=2))
    log(f"[data] stdlib {len(mods.train)} train / {len(mods.heldout)} held-out modules -> {n_train} training "
        f"functions, {n_held} held-out, {n_he} HumanEval (fingerprint {mods.fingerprint[:12]}) -> {root}")
    return files


def task_options(cfg: RealDemoConfig):
    from .tasks import TaskOptions
    return TaskOptions(max_body_lines=cfg.max_body_lines, per_module_cap=cfg.per_module, seed=cfg.seed)


def heldout_records(cfg: RealDemoConfig, tok: Tokenizer, mods) -> list[dict]:
    """The held-out functions of corpus `mods` as the data stage writes them (heldout.jsonl's records)."""
    from .tasks import heldout_records as records
    encode = lambda text: tok.encode(text, add_special_tokens=False)
    return records(mods.heldout, task_options(cfg), encode, cfg.prompt_tokens, limit=cfg.n_heldout)


def prepared_data(root: Path, spec: dict, log=print) -> dict[str, Path]:
    """The files of a data directory made earlier (`data_dir`), refused when incomplete or made with other
    settings than `spec` (its corpus fingerprint is its own: the corpus it was made from)."""
    files = {n: root / f"{n}.jsonl" for n in DATA_FILES}
    missing = [str(f) for f in (*files.values(), root / "settings.json", root / "corpus.json", root / MANIFEST)
               if not f.is_file()]
    if missing:
        raise ConfigError(f"data_dir {str(root)!r} is not a finished data stage: missing {missing}")
    check_manifest(root, files)
    saved = json.loads((root / "settings.json").read_text())
    check_stage_settings(root, {k: v for k, v in saved.items() if k != "corpus_fingerprint"}, spec)
    log(f"[data] using {root} (corpus {saved.get('corpus_fingerprint', '?')[:12]})")
    return files
