"""`make demo-real-eval`: the committed SBD adapter (adapters/, a copy-only LoRA trained on a CPU: its README) on
the installed SmolLM2-135M-Instruct, decoded here on the first held-out functions of its record (record.json, made
by `bench/eval_real.py --record`): every row's completions set next to the recorded ones (token for token), with
first-line exact, similarity and tokens per forward here and as recorded on the same functions. The held-out
functions are made from this interpreter's stdlib with the record's settings (refused, naming both fingerprints,
if the corpus is not the record's).

  python -m demos.real.reproduce [--limit N] [--batch B] [--out DIR] [--adapter DIR] [--no-latency] [--lossy-latency]
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path

from sbd_jax.config import ConfigError, from_dict
from ..toy.report import write_atomic
from sbd_jax.io.tokenizer import Tokenizer
from . import corpus, metrics
from .adapter_eval import evaluate_adapter
from .config import RealDemoConfig
from .stages import heldout_records, stage_base

ADAPTER = Path(__file__).resolve().parents[2] / "adapters" / "smollm2-135m-sbd-copy-lora-r32"
RECORD = "record.json"


def prompt_digest(prompt_ids) -> str:
    """A held-out prompt's fingerprint in a record: the first 16 hex digits of sha256 over its ids."""
    return hashlib.sha256(json.dumps(list(prompt_ids)).encode()).hexdigest()[:16]


def load_record(adapter_dir: Path) -> dict:
    path = Path(adapter_dir) / RECORD
    if not path.is_file():
        raise ConfigError(f"{str(path)!r} is missing: not an adapter committed with its evaluation record")
    return json.loads(path.read_text())


def reproduce(adapter_dir: Path = ADAPTER, out_dir: str = "results/real_eval", limit: int | None = None,
              batch: int | None = None, latency: bool = True, select=None, log=print,
              max_new: int | None = None, lossy_latency: bool = False) -> list[dict]:
    """The adapter's rows (those `select(decoder)` keeps, when given) decoded here on the record's first `limit`
    held-out functions (all: None), at `batch` rows (None: the record's), `max_new` tokens each (None: the
    record's; fewer: compared with the recorded completions' first `max_new` tokens); the batch-1 pass (`latency`)
    times the AR and lossless rows, the lossy ones too with `lossy_latency` (the slowest rows here); -> rows, each with the
    recorded figures on the same functions and tokens ("recorded") and the share of functions decoded token for
    token as recorded ("same_as_record"). Writes compare.md, compare.json and compare.png (`plot`) to `out_dir`."""
    rec = load_record(adapter_dir)
    out = Path(out_dir).absolute()
    cfg = from_dict(RealDemoConfig, {**rec["settings"], "out_dir": str(out)})
    if max_new is not None and not 1 <= max_new <= cfg.max_new_tokens:
        raise ConfigError(f"max_new must be in [1, {cfg.max_new_tokens}] (the record's), got {max_new}")
    cfg = dataclasses.replace(cfg, eval_batch=batch or cfg.eval_batch, latency_n=cfg.latency_n if latency else 0,
                              latency_lossy=lossy_latency, max_new_tokens=max_new or cfg.max_new_tokens)
    mods = corpus.load(cfg.corpus_root)  # the record's corpus, or a refusal before anything is decoded
    if rec.get("corpus") is None:
        raise ConfigError(f"{adapter_dir}/{RECORD} names no corpus (recorded on a data stage's held-out file, "
                          "--heldout): only a record made from the stdlib is decoded again here")
    if mods.fingerprint != rec["corpus"]["fingerprint"]:
        raise ConfigError(f"this interpreter's stdlib ({mods.python}, corpus {mods.fingerprint[:12]}) is not "
                          f"the corpus the adapter was evaluated on ({rec['corpus']['python']}, "
                          f"{rec['corpus']['fingerprint'][:12]}): the held-out functions would differ")
    base = stage_base(cfg, log)
    tok = Tokenizer.load(base)
    ids = rec["functions"][:limit]
    by_id = {r["id"]: r for r in heldout_records(cfg, tok, mods)}
    records = [by_id[i] for i in ids]
    for r in records:  # the same function made into another prompt (the task format changed): not comparable
        want = rec.get("prompt_digests", {}).get(r["id"])
        if want is None or want != prompt_digest(r["prompt_ids"]):
            raise ConfigError(f"held-out function {r['id']!r}: its prompt made here is not the one the record was "
                              f"decoded from ({'no prompt digest in the record' if want is None else 'digests differ'})"
                              ": record the adapter again (bench/eval_real.py --record)")
    rows = evaluate_adapter(cfg, base, Path(adapter_dir), records, log, select=select)
    recorded = {r["label"]: r for r in rec["rows"]}
    for r in rows:
        outs = [recorded[r["label"]]["outputs"][i][:cfg.max_new_tokens] for i in ids]
        r["same_as_record"] = metrics.identical_share(r["outputs"], outs)
        r["recorded"] = {**metrics.heldout_scores(records, [tok.decode(o) for o in outs]),  # the same functions
                         "tokens_per_forward": recorded[r["label"]]["tokens_per_forward"]}
        del r["outputs"]
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "compare.json", json.dumps({"adapter": str(adapter_dir), "functions": ids, "rows": rows},
                                                  indent=1))
    table = comparison_table(rows, rec["device"])
    write_atomic(out / "compare.md", table)
    plot(rows, out / "compare.png")
    log("\n" + table)
    return rows


def comparison_table(rows: list[dict], device: str) -> str:
    ar = next((r for r in rows if r["mode"] == "ar"), None)

    def speed(r, key):  # tokens/s here and its ratio to the base's AR here
        v = r.get(key, float("nan"))
        if v != v:
            return ""
        return f"{v:.1f} ({v / ar[key]:.2f}x)" if ar and ar.get(key, 0) > 0 else f"{v:.1f}"
    head = (f"| row | first-line exact (here / recorded on {device}) | similarity (here / recorded) | tokens per "
            "forward (here / recorded, all its functions) | functions decoded as recorded | rows = base AR here | "
            "tokens/s here (x base AR) | tokens/s at batch 1 here |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")
    return head + "".join(
        f"| {r['label']} | {100 * r['first_line_exact']:.1f}% / {100 * r['recorded']['first_line_exact']:.1f}% "
        f"| {r['similarity']:.3f} / {r['recorded']['similarity']:.3f} "
        f"| {r['tokens_per_forward']:.2f} / {r['recorded']['tokens_per_forward']:.2f} "
        f"| {100 * r['same_as_record']:.0f}% | {100 * r['same_as_base_ar']:.0f}% "
        f"| {speed(r, 'tokens_per_s')} | {speed(r, 'latency_tokens_per_s') if r.get('latency_n') else ''} |\n"
        for r in rows)


def plot(rows: list[dict], path: Path) -> None:
    """Per row: tokens per forward (here and as recorded on all the record's functions) and tokens/s relative to
    the base's AR here (at the batch, and at batch 1 when timed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ar = next((r for r in rows if r["mode"] == "ar"), None)
    labels = [r["label"].replace(" (", "\n(") for r in rows]
    y = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 1.2 + 0.8 * len(rows)), sharey=True)
    a.barh([i + 0.2 for i in y], [r["tokens_per_forward"] for r in rows], 0.4, label="here")
    a.barh([i - 0.2 for i in y], [r["recorded"]["tokens_per_forward"] for r in rows], 0.4, label="recorded")
    a.set_xlabel("tokens per forward")
    a.set_yticks(list(y), labels, fontsize=8)
    a.legend(fontsize=8)
    if ar:
        b.barh([i + 0.2 for i in y], [r["tokens_per_s"] / ar["tokens_per_s"] for r in rows], 0.4, label="batch")
        lat = [r["latency_tokens_per_s"] / ar["latency_tokens_per_s"] if r.get("latency_n") else 0.0 for r in rows]
        b.barh([i - 0.2 for i in y], lat, 0.4, label="batch 1")
        b.axvline(1.0, color="grey", linewidth=1)
        b.legend(fontsize=8)
    b.set_xlabel("tokens/s relative to the base model's AR")
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle("The committed SBD adapter on held-out stdlib functions (demos/real/reproduce.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m demos.real.reproduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="the first N held-out functions (default: all)")
    ap.add_argument("--batch", type=int, default=None, help="rows per batch (default: the record's)")
    ap.add_argument("--out", default="results/real_eval")
    ap.add_argument("--adapter", default=str(ADAPTER))
    ap.add_argument("--no-latency", action="store_true", help="skip the batch-1 timing pass")
    ap.add_argument("--lossy-latency", action="store_true",
                    help="time the lossy rows at batch 1 too (~4 more minutes at 16 functions on 2 cores)")
    ap.add_argument("--max-new", type=int, default=None, help="tokens per function (default: the record's)")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit must be >= 1, got {args.limit}")
    try:
        reproduce(Path(args.adapter), args.out, args.limit, args.batch, not args.no_latency, max_new=args.max_new,
                  lossy_latency=args.lossy_latency)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
