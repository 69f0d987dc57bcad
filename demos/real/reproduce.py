"""`make demo-real-eval`: the real-model table's SBD rows again on any CPU, from the installed SmolLM2-135M-Instruct
and the LoRA adapter committed in adapters/ (trained on a GPU by bench/gpu_campaign.sh; its record.json holds that
run's settings, corpus record and rows with every held-out completion). The held-out functions are made here
from this interpreter's stdlib with the run's settings (refused, naming both fingerprints, if the corpus is not
the run's); every adapter row of the table is decoded again and set next to the GPU's: first-line exact,
similarity, tokens per forward, and the share of functions completed token for token as on the GPU.

  python -m demos.real.reproduce [--limit N] [--batch B] [--out DIR] [--adapter DIR] [--wide-cost C] [--no-latency]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from sbd_jax.config import ConfigError, from_dict
from ..toy.report import write_atomic
from sbd_jax.io.tokenizer import Tokenizer
from . import corpus, metrics
from .config import RealDemoConfig
from .evaluation import compare, evaluate
from .stages import heldout_records, stage_base

ADAPTER = Path(__file__).resolve().parents[2] / "adapters" / "smollm2-135m-sbd-lora-r16"
RECORD = "record.json"


def load_record(adapter_dir: Path) -> dict:
    path = Path(adapter_dir) / RECORD
    if not path.is_file():
        raise ConfigError(f"{str(path)!r} is missing: not an adapter committed with its GPU run's record")
    return json.loads(path.read_text())


def reproduce(adapter_dir: Path = ADAPTER, out_dir: str = "results/real_eval", limit: int | None = None,
              batch: int | None = None, latency: bool = True, select=None, log=print, **overrides) -> list[dict]:
    """The adapter's rows (those `select(decoder)` keeps, when given) decoded here on the first `limit` held-out
    functions (all: None), at `batch` rows (None: the run's); -> rows, each with the GPU's figures on the same
    functions ("gpu": first-line exact, similarity; tokens per forward over all of its functions) and the share of
    functions decoded token for token as on the GPU ("same_as_gpu"). Writes compare.md and compare.json to
    `out_dir`. `overrides`: RealDemoConfig fields that change no decoded token (e.g. a stated wide_cost)."""
    rec = load_record(adapter_dir)
    out = Path(out_dir).absolute()
    settings = {**rec["config"], "out_dir": str(out), "gguf": None, "data_dir": None, **overrides}
    cfg = from_dict(RealDemoConfig, settings)
    cfg = dataclasses.replace(cfg, eval_batch=batch or cfg.eval_batch, latency_n=cfg.latency_n if latency else 0)
    mods = corpus.load(cfg.corpus_root)  # the run's corpus, or a refusal before anything is decoded
    if mods.fingerprint != rec["corpus"]["fingerprint"]:
        raise ConfigError(f"this interpreter's stdlib ({mods.python}, corpus {mods.fingerprint[:12]}) is not "
                          f"the corpus the adapter's run was evaluated on ({rec['corpus']['python']}, "
                          f"{rec['corpus']['fingerprint'][:12]}): the held-out functions would differ")
    base = stage_base(cfg, log)
    tok = Tokenizer.load(base)
    records = heldout_records(cfg, tok, mods)[:limit]
    ids = [r["id"] for r in records]
    rows = evaluate(cfg, {"base": base, "lora": (base, Path(adapter_dir))}, records, [], log,
                    select=lambda d: d.model == "lora" and (select is None or select(d)))
    gpu = {r["label"]: r for r in rec["rows"]}
    for r in rows:
        outs = [gpu[r["label"]]["outputs"][i] for i in ids]
        r["same_as_gpu"] = sum(a == b for a, b in zip(r["outputs"], outs)) / len(ids)
        r["gpu"] = {**metrics.heldout_scores(records, [tok.decode(o) for o in outs]),  # the same functions
                    "tokens_per_forward": gpu[r["label"]]["tokens_per_forward"]}
    rows = compare(rows)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "compare.json", json.dumps({"adapter": str(adapter_dir), "functions": ids, "rows": rows}, indent=1))
    table = comparison_table(rows, rec["device"])
    write_atomic(out / "compare.md", table)
    log("\n" + table)
    return rows


def comparison_table(rows: list[dict], device: str) -> str:
    head = (f"| row | first-line exact (here / {device}) | similarity (here / GPU) | tokens per forward (here / GPU, "
            "all its functions) "
            "| functions decoded as on the GPU | rows = same model's AR here |\n|---|---:|---:|---:|---:|---:|\n")
    return head + "".join(
        f"| {r['label']} | {100 * r['first_line_exact']:.1f}% / {100 * r['gpu']['first_line_exact']:.1f}% "
        f"| {r['similarity']:.3f} / {r['gpu']['similarity']:.3f} "
        f"| {r['tokens_per_forward']:.2f} / {r['gpu']['tokens_per_forward']:.2f} | {100 * r['same_as_gpu']:.0f}% "
        f"| {100 * r['same_as_ar']:.0f}% |\n" for r in rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m demos.real.reproduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="the first N held-out functions (default: all)")
    ap.add_argument("--batch", type=int, default=None, help="rows per batch (default: the GPU run's)")
    ap.add_argument("--out", default="results/real_eval")
    ap.add_argument("--adapter", default=str(ADAPTER))
    ap.add_argument("--no-latency", action="store_true", help="skip the batch-1 timing pass")
    # the lossless rows' drafting decisions change their calls, never their tokens
    ap.add_argument("--wide-cost", type=float, default=0.0,
                    help="lossless rows: the widest call's cost in AR calls (0: the cost model's)")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit must be >= 1, got {args.limit}")
    if args.wide_cost < 0:
        ap.error(f"--wide-cost must be >= 0, got {args.wide_cost}")
    reproduce(Path(args.adapter), args.out, args.limit, args.batch, not args.no_latency,
              wide_cost=args.wide_cost or None)


if __name__ == "__main__":
    main()
