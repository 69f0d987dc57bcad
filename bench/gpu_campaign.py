"""The GPU campaign's Python side (bench/gpu_campaign.sh runs it; see there for the calls):

  prepare --carry DIR [--gguf FILE] [--corpus-root DIR]   the model file in pieces with checksums, the data
  join --carry DIR --work DIR                              the pieces taken by the calls -> the file, checked
  real --work DIR [--train-only]                           `make demo-real` at the campaign's size
  draft data|train|eval --work DIR                         the draft recipe (docs/training.md "Drafts in hours"):
                                                           the base's greedy continuations of windows of the
                                                           training functions, a copy-only adapter on them, the
                                                           table (bench/eval_real.py) on the held-out functions

Why pieces: one device call carries at most 64 MiB (the working tree included) and the SmolLM2 GGUF is 93.8 MiB,
so three consecutive calls on the same warm machine each carry one piece (`pN/`), copied to the work directory,
and `join` checks every piece's and the whole file's sha256 before anything reads it. Why the data travels: the
GPU machine's interpreter is another patch release (another stdlib); the data made here is the data any CPU rerun
here evaluates on.

The sizes: SIZE "gpu" (the campaign) or "tiny" (the CPU dry run of tests/test_gpu_campaign.py: the same calls on
a tiny model, a few stdlib modules and a few steps).
"""
from __future__ import annotations

import argparse
import dataclasses
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
# `make demo-real` at the size the campaign's budget allows (an H100, 15 minutes of device time in all): 1200 steps of
# 16 rows of 512 tokens (~6 epochs of the training functions), bf16 compute without remat (135M fits), one
# checkpoint; ~6.5 minutes for the three fine-tunes (10 / 20 / 7.6 steps per second for SBD / NTP / LoRA on the
# H100 of 2026-11-27, + ~15 s each to load, compile and export). 300 steps taught the mask rows too little
# (BENCHMARKS.md, "SBD on a real model"). Evaluation (~4 minutes): 128 held-out functions (no HumanEval: ~0 for a
# 135M model), 160 new tokens, the adaptive lossless policy, EB at three gammas, one threshold row; lossy rows timed
# at batch 32 only (fewer programs).
DATA = dict(prompt_tokens=256, n_heldout=128, n_humaneval=0)
GPU = dict(DATA, seq_len=512, batch_size=16, steps=1200, lr=2e-4, warmup_steps=50, remat="none", dtype="bfloat16",
           checkpoints=1, lora_rank=16, lora_alpha=32.0, lora_lr=1e-3, max_new_tokens=160, eval_batch=32,
           latency_n=8, latency_lossy=False, lossless_policies=("adaptive",), gammas=(0.35, 1.0, 3.0),
           threshold_gammas=(0.35,))
# the dry run: the GPU settings' stages and options (lossy rows at batch 32 only, one checkpoint, the adapter) with
# two HumanEval problems (the harness) and one admission of all 5 prompts; no threshold row (that decoder path is
# tested in tests/test_decoding.py), to keep the suite's time
TINY = dict(prompt_tokens=96, n_heldout=3, n_humaneval=2, max_body_lines=8, per_module=4, seq_len=160, batch_size=2,
            steps=2, warmup_steps=1, remat="none", checkpoints=1, lora_rank=2, max_new_tokens=16, eval_batch=8,
            latency_n=1, latency_lossy=False, lossless_policies=("adaptive",), gammas=(0.35,), threshold_gammas=())


# the draft recipe at the campaign's size: windows of `prompt_len` tokens every `stride` tokens of the training
# functions (prompt + body), each continued greedily for `max_new` tokens by the base (~30k prompts, ~4M tokens on
# the stdlib); the copy-only adapter (configs/smollm2_copy_lora.yaml) trained `steps` x `batch` rows; 128 held-out
# functions evaluated
DRAFT = {"gpu": dict(prompt_len=192, stride=48, max_new=128, decode_batch=512, steps=1500, batch=32,
                     dtype="bfloat16", eval_limit=128, eval_batch=32, latency_n=8, max_prompts=None),
         "tiny": dict(prompt_len=48, stride=64, max_new=12, decode_batch=8, steps=2, batch=2, dtype=None,
                      eval_limit=2, eval_batch=4, latency_n=1, max_prompts=6)}


def window_prompts(records, tok, prompt_len: int, stride: int, limit: int | None = None) -> list[dict]:
    """Prompts of `prompt_len` token ids ending every `stride` tokens of each training record (prompt + response,
    tokenized as training tokenizes them), at most `limit`."""
    out = []
    for n, r in enumerate(records):
        ids = tok.encode(r["prompt"], add_special_tokens=False) + tok.encode(r["response"], add_special_tokens=False)
        for end in range(prompt_len, len(ids) + 1, stride):
            out.append({"id": f"w{n}-{end}", "prompt_ids": ids[end - prompt_len:end]})
            if limit is not None and len(out) == limit:
                return out
    return out


def _decode_greedy(base: Path, prompts: Path, out: Path, d: dict) -> None:
    import decode  # the project's batch decoder, resumable
    rc = decode.main(["--model", str(base), "--input", str(prompts), "--output", str(out), "--mode", "ar",
                      "--max-new-tokens", str(d["max_new"]), "--batch-size", str(d["decode_batch"]), "--no-progress",
                      "--resume" if out.exists() else "--overwrite"])
    if rc:
        raise SystemExit(f"draft: decoding {prompts} failed ({rc})")


def draft(args) -> None:
    """The draft recipe's stages in <work>/draft: data (prompts, the base's greedy continuations, the id records),
    train (the copy-only adapter), eval (the table)."""
    from demos.real.evaluation import read_records
    from demos.real.stages import stage_base
    from sbd_jax.io.tokenizer import Tokenizer
    from sbd_jax.training.distill import join as join_records
    work, d = Path(args.work), DRAFT[args.size]
    out = work / "draft"
    out.mkdir(parents=True, exist_ok=True)
    base = stage_base(config(args.size, out_dir=str(out), gguf=str(work / GGUF_NAME)))
    if args.stage == "data":
        tok = Tokenizer.load(base)
        train = window_prompts(read_records(work / "data" / "train.jsonl"), tok, d["prompt_len"], d["stride"],
                               d["max_prompts"])
        held = [{"id": r["id"], "prompt_ids": r["prompt_ids"][-d["prompt_len"]:]}
                for r in read_records(work / "data" / "heldout.jsonl")]
        for name, rows in (("train", train), ("heldout", held)):
            prompts = out / f"{name}_prompts.jsonl"
            prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
            _decode_greedy(base, prompts, out / f"{name}_greedy.jsonl", d)
            n = join_records(prompts, out / f"{name}_greedy.jsonl", out / f"{name}_distilled.jsonl")
            print(f"draft data: {n} {name} records")
    elif args.stage == "train":
        import importlib.util
        spec = importlib.util.spec_from_file_location("train_cli", Path(__file__).resolve().parents[1] / "train.py")
        train_py = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(train_py)
        rc = train_py.main(["--config", str(Path(__file__).resolve().parents[1] / "configs" / "smollm2_copy_lora.yaml"),
                            f"model.init_from={base}", f"data.tokenizer={base}",
                            f"data.path={out / 'train_distilled.jsonl'}",
                            f"draft_eval.path={out / 'heldout_distilled.jsonl'}", f"out_dir={out / 'run'}",
                            f"steps={d['steps']}", f"batch_size={d['batch']}", "progress=false"]
                           + ([f"model.dtype={d['dtype']}"] if d["dtype"] else [])
                           + (["draft_eval.prompt_len=48", "draft_eval.cont_len=12", "draft_eval.block_size=4",
                               "data.seq_len=64", "data.copy_len=16"] if args.size == "tiny" else []))
        if rc:
            raise SystemExit(f"draft: training failed ({rc})")
    else:
        import eval_real
        eval_real.main(["--adapter", str(out / "run" / "adapter"), "--model", str(base),
                        "--heldout", str(work / "data" / "heldout.jsonl"), "--limit", str(d["eval_limit"]),
                        "--batch", str(d["eval_batch"]), "--latency-n", str(d["latency_n"]),
                        "--prompt-tokens", str(d["prompt_len"]), "--max-new-tokens", str(d["max_new"]),
                        "--policies", "adaptive", "always", "--out", str(out / "eval")])


def config(size: str, **kw):
    from demos.real.config import RealDemoConfig
    return RealDemoConfig(**{**(GPU if size == "gpu" else TINY), **kw})


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
    cfg = config(args.size, out_dir=str(work), gguf=str(src), corpus_root=args.corpus_root)
    files = stage_data(cfg, Tokenizer.load(stage_base(cfg)))
    data = dirs[-1] / "data"
    shutil.copytree(Path(files["train"]).parent, data)
    shutil.rmtree(work)
    sizes = {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) / 2**20 for d in dirs}
    print(f"prepare: {src} -> {', '.join(f'{k} {v:.1f} MiB' for k, v in sizes.items())} in {carry}")


def real(args) -> None:
    """`make demo-real` at the campaign's size on the joined file and the carried data."""
    work = Path(args.work)
    if args.size == "gpu":  # the persistent cache: programs shared by several rows compile once
        import jax
        jax.config.update("jax_compilation_cache_dir", str(work / "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from demos.real.pipeline import run
    cfg = config(args.size, out_dir=str(work / "real"), gguf=str(work / GGUF_NAME), data_dir=str(work / "data"),
                 corpus_root=args.corpus_root)
    print(json.dumps(dataclasses.asdict(cfg)), flush=True)
    run(cfg, train_only=args.train_only)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("prepare", "join", "real", "draft"))
    ap.add_argument("stage", nargs="?", choices=("data", "train", "eval"), help="draft: which stage")
    ap.add_argument("--size", choices=("gpu", "tiny"), default=os.environ.get("CAMPAIGN_SIZE", "gpu"))
    ap.add_argument("--carry", default=".gpu_carry")
    ap.add_argument("--work", default="/tmp/sbd_campaign")
    ap.add_argument("--gguf", default=None, help="prepare: the model file (default: SmolLM2-135M-Instruct's)")
    ap.add_argument("--corpus-root", default=None, help="the data's corpus (default: this interpreter's stdlib)")
    ap.add_argument("--train-only", action="store_true", help="real: the fine-tunes only (evaluated by a later run)")
    args = ap.parse_args(argv)
    if args.command == "prepare":
        prepare(args)
    elif args.command == "join":
        join(Path(args.work) / "pieces", Path(args.work) / GGUF_NAME)
    elif args.command == "draft":
        if args.stage is None:
            ap.error("draft needs a stage: data, train or eval")
        draft(args)
    else:
        real(args)


if __name__ == "__main__":
    main()
