"""The paper's pipeline (Table 1) in miniature, on a CPU:

  data      deterministic task suite (tasks.py) + a BPE tokenizer trained locally (tokenizer.py)
  pretrain  a small Llama-style model trained with NTP on worked solutions
  ft_ntp    fine-tune copy 1: NTP only (the baseline)           } same data, same steps,
  ft_sbd    fine-tune copy 2: SBD dual loss (NTP + MATP)        } same optimizer
  eval      held-out problems: baseline with AR decoding; SBD model with AR, lossless SBD (one row per
            drafting policy of `lossless_policies`) and lossy SBD at several gammas (block size 16);
            accuracy, tokens per forward (NFE speedup) and measured tokens/s, all in the same run
            -> table (markdown + json) and a PNG plot.

Every stage leaves its result in `out_dir` and is skipped when rerun (training stages resume from
their last checkpoint when interrupted).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax

from .config import DemoConfig
from .evaluation import evaluate
from .report import family_table, markdown_table, plot, write_atomic
from .stages import model_config, stage_data, stage_train, train_config


def run(cfg: DemoConfig, log=print) -> list[dict]:
    out = Path(cfg.out_dir).absolute()
    cfg = dataclasses.replace(cfg, out_dir=str(out))
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    t0 = time.time()
    files = stage_data(cfg, log)
    base_model = model_config(cfg, files["tokenizer"])
    pre = stage_train("pretrain", train_config(cfg, files["pretrain"], files["tokenizer"], mode="text",
                                                steps=cfg.pretrain_steps, lr=cfg.pretrain_lr, ntp_only=True,
                                                init_from=None, model=base_model, out=out / "pretrain"), log)
    models = {}
    for name, ntp_only in (("ntp", True), ("sbd", False)):
        models[name] = stage_train(f"ft_{name}", train_config(
            cfg, files["finetune"], files["tokenizer"], mode="sft", steps=cfg.finetune_steps, lr=cfg.finetune_lr,
            ntp_only=ntp_only, init_from=str(pre), model=None, out=out / f"ft_{name}"), log)
    res_file = out / "results.json"
    prev = json.loads(res_file.read_text()) if res_file.exists() else None
    if prev is not None and prev.get("config") == json.loads(json.dumps(dataclasses.asdict(cfg))):
        log(f"[eval] reusing {res_file}")
        rows = prev["rows"]
    else:
        rows = evaluate(cfg, models, files["test"], files["tokenizer"], log)
    table = markdown_table(rows, cfg.eval_batch) + "\nAccuracy per task family:\n\n" + family_table(rows)
    write_atomic(out / "table.md", table)
    write_atomic(res_file, json.dumps({"config": dataclasses.asdict(cfg), "rows": rows,
                                       "device": str(jax.devices()[0].device_kind),
                                       "total_seconds": time.time() - t0}, indent=2))
    plot(rows, out / "accuracy_vs_speedup.png", cfg.eval_batch)
    log("\n" + table)
    log(f"table: {out / 'table.md'}  json: {out / 'results.json'}  plot: {out / 'accuracy_vs_speedup.png'}  "
        f"({time.time() - t0:.0f}s)")
    return rows
