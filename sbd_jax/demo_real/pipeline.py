"""The paper's comparison on a real pretrained model (SmolLM2-135M-Instruct unless `gguf` names another):

  base      the GGUF converted once to an HF directory (sbd_jax.io.gguf)
  data      the interpreter's stdlib split by module: training functions (SFT pairs), held-out functions, HumanEval
  ft_ntp    fine-tune 1: NTP only (the baseline)           } same data, same steps,
  ft_sbd    fine-tune 2: SBD dual loss, k ~ U[2, k_max]    } same optimizer
  eval      the original model AR; both fine-tunes AR; the SBD fine-tune lossless (verify, one row per drafting
            policy of `lossless_policies`) and with the lossy EB and threshold rules at several gammas
            -> table.md, results.json, a plot

Every stage leaves its result in `out_dir` and is skipped when rerun; training stages resume from their last
checkpoint; a stage made with other settings is refused, naming the difference.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax

from ..demo.report import write_atomic
from ..demo.stages import stage_train
from ..io.tokenizer import Tokenizer
from .config import RealDemoConfig
from .evaluation import evaluate
from .report import markdown_table, plot
from .stages import stage_base, stage_data, train_config


def run(cfg: RealDemoConfig, log=print) -> list[dict]:
    out = Path(cfg.out_dir).absolute()
    cfg = dataclasses.replace(cfg, out_dir=str(out))
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "demo_config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    t0 = time.time()
    base = stage_base(cfg, log)
    files = stage_data(cfg, Tokenizer.load(base), log)
    models = {"base": base}
    for name, ntp_only in (("ntp", True), ("sbd", False)):
        models[name] = stage_train(f"ft_{name}", train_config(cfg, base, files["train"], ntp_only=ntp_only,
                                                              out=out / f"ft_{name}"), log)
    res_file = out / "results.json"
    prev = json.loads(res_file.read_text()) if res_file.exists() else None
    corpus = json.loads((out / "data" / "corpus.json").read_text())
    if prev is not None and prev.get("config") == json.loads(json.dumps(dataclasses.asdict(cfg))):
        log(f"[eval] reusing {res_file}")
        rows = prev["rows"]
    else:
        rows = evaluate(cfg, models, files, log)
    table = markdown_table(rows, cfg.eval_batch)
    write_atomic(out / "table.md", table)
    write_atomic(res_file, json.dumps({"config": dataclasses.asdict(cfg), "rows": rows, "corpus": corpus,
                                       "device": str(jax.devices()[0].device_kind),
                                       "total_seconds": time.time() - t0}, indent=2))
    plot(rows, out / "quality_vs_speedup.png")
    log("\n" + table)
    log(f"table: {out / 'table.md'}  json: {res_file}  plot: {out / 'quality_vs_speedup.png'} ({time.time() - t0:.0f}s)")
    return rows
