"""The paper's comparison on a real pretrained model (SmolLM2-135M-Instruct unless `gguf` names another):

  base      the GGUF converted once to an HF directory (sbd_jax.io.gguf)
  data      the interpreter's stdlib split by module: training functions (SFT pairs), held-out functions, HumanEval
  ft_sbd    fine-tune 1: SBD dual loss, k ~ U[2, k_max]    } same data, same steps,
  ft_ntp    fine-tune 2: NTP only (the baseline)           } same optimizer
  ft_sbd_lora  the SBD fine-tune as a LoRA adapter (rank `lora_rank`, the `<m>` row trained; 0: skipped)
  eval      the original model AR; both fine-tunes AR; the SBD fine-tune lossless (verify, one row per drafting
            policy of `lossless_policies`) and with the lossy EB and threshold rules at several gammas; the same
            rows for the adapter -> table.md (with the acceptance histograms), results.json, a plot

Every stage leaves its result in `out_dir` and is skipped when rerun; training stages resume from their last
checkpoint; evaluation saves each finished row (eval_rows.jsonl) and resumes by row, most needed rows first
(evaluation.eval_order), rewriting table.md after each; a stage made with other settings is refused, naming the
difference.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax

from ..toy.report import write_atomic
from ..toy.stages import stage_train
from sbd_jax.io.tokenizer import Tokenizer
from .config import RealDemoConfig
from .evaluation import compare, evaluate, read_records
from .report import acceptance_table, markdown_table, plot
from .stages import stage_base, stage_data, train_config


def run(cfg: RealDemoConfig, log=print, *, train_only: bool = False) -> list[dict]:
    """Every stage (`train_only`: up to the fine-tunes, e.g. in a process with other XLA flags than the
    evaluation's) -> the table's rows."""
    out = Path(cfg.out_dir).absolute()
    cfg = dataclasses.replace(cfg, out_dir=str(out))
    out.mkdir(parents=True, exist_ok=True)
    settings = json.loads(json.dumps(dataclasses.asdict(cfg)))
    write_atomic(out / "demo_config.json", json.dumps(settings, indent=2))
    t0 = time.time()
    base = stage_base(cfg, log)
    files = stage_data(cfg, Tokenizer.load(base), log)
    models = {"base": base}
    for name, ntp_only in (("sbd", False), ("ntp", True)):  # the SBD fine-tune first: the run's point
        models[name] = stage_train(f"ft_{name}", train_config(cfg, base, files["train"], ntp_only=ntp_only,
                                                              out=out / f"ft_{name}"), log)
    if cfg.lora_rank:
        adapter = stage_train("ft_sbd_lora", train_config(cfg, base, files["train"], ntp_only=False, lora=True,
                                                          out=out / "ft_sbd_lora"), log)
        models["lora"] = (base, adapter)
    if train_only:
        return []
    res_file = out / "results.json"
    prev = json.loads(res_file.read_text()) if res_file.exists() else None
    corpus = json.loads((Path(files["train"]).parent / "corpus.json").read_text())
    device = str(jax.devices()[0].device_kind)

    def report(rows: list[dict], final: bool) -> list[dict]:
        rows = compare(rows)
        write_atomic(out / "table.md", markdown_table(rows, cfg.eval_batch) + "\n" + acceptance_table(rows))
        write_atomic(res_file, json.dumps({"config": settings, "rows": rows, "corpus": corpus, "device": device,
                                           "training": training_record(out), "complete": final,
                                           "total_seconds": time.time() - t0}, indent=2))
        return rows

    if prev is not None and prev.get("config") == settings and prev.get("complete", True):
        log(f"[eval] reusing {res_file}")
        rows = prev["rows"]
    else:
        rows = report(evaluate_by_row(cfg, models, files, out / "eval_rows.jsonl", settings,
                                      lambda finished: report(finished, final=False), log), final=True)
    plot(rows, out / "quality_vs_speedup.png")
    log("\n" + (out / "table.md").read_text())
    log(f"table: {out / 'table.md'}  json: {res_file}  plot: {out / 'quality_vs_speedup.png'} ({time.time() - t0:.0f}s)")
    return rows


def evaluate_by_row(cfg: RealDemoConfig, models: dict, files: dict[str, Path], store: Path, settings: dict,
                    progress, log=print) -> list[dict]:
    """`evaluate`, every finished row (with its outputs) appended to `store` under the run's settings, so that a
    stopped run resumes by row; `progress(rows so far)` after each."""
    done = {}
    if store.exists():
        lines = [json.loads(x) for x in store.read_text().splitlines() if x.strip()]
        if lines and lines[0].get("config") == settings:
            done = {r["label"]: r for r in lines[1:]}
            log(f"[eval] reusing {len(done)} finished rows of {store}")
    if not done:
        write_atomic(store, json.dumps({"config": settings}) + "\n")
    finished = list(done.values())

    def on_row(r):
        with store.open("a") as f:
            f.write(json.dumps(r) + "\n")
        finished.append(r)
        progress(finished)

    held, humaneval = (read_records(files[n]) for n in ("heldout", "humaneval"))
    return evaluate(cfg, models, held, humaneval, log, done=done, on_row=on_row)


def training_record(out: Path) -> dict:
    """Each finished fine-tune's DONE record (wall seconds, last logged losses)."""
    return {d.name: json.loads((d / "DONE").read_text()) for d in sorted(out.glob("ft_*")) if (d / "DONE").is_file()}
