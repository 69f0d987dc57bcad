"""The GPU campaign's Python side (bench/gpu_campaign.sh runs it; see there for the calls):

  prepare --carry DIR [--gguf FILE] [--corpus-root DIR]   the model file in pieces with checksums, the data
  join --carry DIR --work DIR                              the pieces taken by the calls -> the file, checked
  draft distill|train|eval --work DIR                      `make demo-real` (demos/real/recipe.py) at the
                                                           campaign's size: the base's greedy continuations of
                                                           windows of the training functions, a copy-only adapter
                                                           on them, the table on the held-out functions

Why pieces: one device call carries at most 64 MiB (the working tree included) and the SmolLM2 GGUF is 93.8 MiB,
so three consecutive calls on the same warm machine each carry one piece (`pN/`), copied to the work directory,
and `join` checks every piece's and the whole file's sha256 before anything reads it. Why the data travels: the
GPU machine's interpreter is another patch release (another stdlib); the data made here is the data any CPU rerun
here evaluates on.

The sizes (demos/real/recipe.py SIZES): "gpu" (the campaign) or "tiny" (the CPU dry run of
tests/test_demo_real.py: the same calls on a tiny model, a few stdlib modules and a few steps).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PIECES = 3  # 31 MiB each: one piece, the wheels and the working tree (~25 MiB with the adapter) fit a call
GGUF_NAME = "model.gguf"


def recipe_size(size: str):
    from demos.real.recipe import SIZES
    return SIZES[size]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def split(src: Path, carry: Path, pieces: int = PIECES) -> list[Path]:
    """carry/p1 .. pN: the file's consecutive pieces, each with a manifest (piece name, size, sha256, and the whole
    file's size and sha256)."""
    data_size = src.stat().st_size
    step = -(-data_size // pieces)
    whole = {"name": GGUF_NAME, "size": data_size, "sha256": sha256(src), "pieces": pieces}
    out = []
    with src.open("rb") as f:
        for i in range(1, pieces + 1):
            d = carry / f"p{i}"
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            part = d / f"{GGUF_NAME}.part{i}"
            part.write_bytes(f.read(step))
            (d / "manifest.json").write_text(json.dumps({**whole, "piece": i, "piece_size": part.stat().st_size,
                                                         "piece_sha256": sha256(part)}))
            out.append(d)
    return out


def join(pieces_dir: Path, dest: Path) -> Path:
    """The pieces in `pieces_dir` (copied there by the calls, with their manifests) -> `dest`, every piece and the
    whole checked; a missing or damaged piece is named. Renamed into place: `dest` exists only when whole."""
    manifests = sorted(pieces_dir.glob("manifest*.json"))
    if not manifests:
        raise SystemExit(f"join: no manifest in {pieces_dir}")
    whole = json.loads(manifests[0].read_text())
    tmp = dest.with_name(f".{dest.name}.tmp")
    with tmp.open("wb") as out:
        for i in range(1, whole["pieces"] + 1):
            part = pieces_dir / f"{whole['name']}.part{i}"
            man = pieces_dir / f"manifest{i}.json"
            if not part.is_file() or not man.is_file():
                raise SystemExit(f"join: piece {i} of {whole['pieces']} is missing from {pieces_dir} (its call did "
                                 "not run on this machine?)")
            want = json.loads(man.read_text())
            if want["sha256"] != whole["sha256"] or sha256(part) != want["piece_sha256"]:
                raise SystemExit(f"join: piece {i} ({part}) is damaged or of another file")
            out.write(part.read_bytes())
    if tmp.stat().st_size != whole["size"] or sha256(tmp) != whole["sha256"]:
        tmp.unlink()
        raise SystemExit(f"join: the joined file does not match its sha256 {whole['sha256']}")
    tmp.replace(dest)
    print(f"join: {dest} ({whole['size']} bytes, sha256 {whole['sha256'][:16]}...) from {whole['pieces']} pieces")
    return dest


def prepare(args) -> None:
    """carry/p1 .. pN (the GGUF's pieces; the data directory travels in the last one as data/)."""
    from demos.real.stages import stage_base, stage_data
    from demos.real_model import gguf_path
    from sbd_jax.io.tokenizer import Tokenizer
    carry = Path(args.carry)
    src = Path(args.gguf) if args.gguf else gguf_path()
    dirs = split(src, carry)
    work = carry / ".data_stage"
    cfg = recipe_size(args.size).data_config(work, gguf=str(src), corpus_root=args.corpus_root)
    files = stage_data(cfg, Tokenizer.load(stage_base(cfg)))
    data = dirs[-1] / "data"
    shutil.copytree(Path(files["train"]).parent, data)
    shutil.rmtree(work)
    sizes = {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) / 2**20 for d in dirs}
    print(f"prepare: {src} -> {', '.join(f'{k} {v:.1f} MiB' for k, v in sizes.items())} in {carry}")


def draft(args) -> None:
    """The draft recipe's stage (demos/real/recipe.py: distill, train or eval) on the joined file and the carried
    data, in <work>/draft."""
    work = Path(args.work)
    if args.size == "gpu" and args.stage == "eval":  # the persistent cache: programs shared by rows compile once
        import jax
        jax.config.update("jax_compilation_cache_dir", str(work / "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from demos.real.recipe import run
    run(work, args.size, (args.stage,), gguf=str(work / GGUF_NAME), corpus_root=args.corpus_root,
        data_dir=str(work / "data"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("prepare", "join", "draft"))
    ap.add_argument("stage", nargs="?", choices=("distill", "train", "eval"), help="draft: which stage")
    ap.add_argument("--size", choices=("gpu", "tiny"), default=os.environ.get("CAMPAIGN_SIZE", "gpu"))
    ap.add_argument("--carry", default=".gpu_carry")
    ap.add_argument("--work", default="/tmp/sbd_campaign")
    ap.add_argument("--gguf", default=None, help="prepare: the model file (default: SmolLM2-135M-Instruct's)")
    ap.add_argument("--corpus-root", default=None, help="the data's corpus (default: this interpreter's stdlib)")
    args = ap.parse_args(argv)
    if args.command == "prepare":
        prepare(args)
    elif args.command == "join":
        join(Path(args.work) / "pieces", Path(args.work) / GGUF_NAME)
    else:
        if args.stage is None:
            ap.error("draft needs a stage: distill, train or eval")
        draft(args)


if __name__ == "__main__":
    main()
