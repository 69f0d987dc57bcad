"""Recipe options for SBD drafts compared at equal CPU time on the draft metric (issue 50, point 2).

Each recipe is configs/smollm2_copy_lora.yaml plus overrides, trained by train.py with single-threaded XLA (so two
runs share this 2-core CPU without slowing each other's clock) until its CPU seconds (every thread of its process,
draft metric excluded: `cpu_seconds` in draft_quality.jsonl) reach --budget; the learning rate is constant after
warmup, so a run cut at the budget is not penalized against one that planned its decay. A rerun resumes each
unfinished run from its checkpoint. Then the table (results.json, printed as markdown) and the plot of the draft
metric against CPU seconds. `--lossy N` then exports each run's adapter at its last checkpoint and decodes N
held-out functions with the lossy EB rule (lossy.json): whole-block drafts, which the draft metric judges, are
not what EB refinement sees (partly decoded blocks), so a mask-rate option is judged on the lossy rows' quality.

    python bench/recipe_compare.py --model MODEL_DIR --distilled train_distilled.jsonl \
        --heldout heldout_distilled.jsonl --human train.jsonl --out bench/results/recipes --budget 2400
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (what it tests, data source, overrides of configs/smollm2_copy_lora.yaml as it is now; a saved run's
# train_config.json has the settings it ran with)
RECIPES = {
    "copy-distilled": ("the recipe: copy-only LoRA r32, self-distilled data, all-masked blocks of 2..4, decay 0.85",
                       "distilled", []),
    "copy-human": ("data: the functions' own bodies instead of the model's continuations", "human", []),
    "lora-every-row": ("what trains: LoRA on clean and copy rows, NTP kept, the paper's eta ~ U[0, 1]", "distilled",
                       ["lora.copy_only=false", "sbd.eta=[0.0,1.0]", "model.remat=full"]),
    "all-weights": ("what trains: every weight (no adapter), the NTP term kept, the recipe's data and blocks",
                    "distilled", ["lora=null"]),
    "copy-k16": ("blocks: the paper's k ~ U[2, 16] instead of U[2, 4]", "distilled", ["sbd.k_max=16"]),
    "copy-k8": ("blocks: k ~ U[2, 8] instead of U[2, 4]", "distilled", ["sbd.k_max=8"]),
    "copy-no-decay": ("position weights: every offset weighted 1", "distilled", ["sbd.position_decay=null"]),
    "copy-skip0": ("position weights: offset 0 weighted 0 (verify mode never uses a block's first draft)",
                   "distilled", ["sbd.offset0_weight=0.0"]),
    "copy-mask-zero": ("the `<m>` row's init: zero instead of the embedding rows' mean", "distilled",
                       ["model.mask_init=zero"]),
    "copy-mask-random": ("the `<m>` row's init: a fresh token's (normal, the embedding's std) instead of the mean",
                         "distilled", ["model.mask_init=random"]),
    "copy-lr3e-3": ("lr 3e-3 instead of 1e-3", "distilled", ["optim.lr=3.0e-3"]),
    "copy-soft": ("targets: half the data's token, half the base's next-token distribution (sbd.soft_targets=0.5)",
                  "distilled", ["sbd.soft_targets=0.5"]),
    "copy-eta": ("mask rate: the paper's eta ~ U[0, 1] per document instead of all-masked blocks", "distilled",
                 ["sbd.eta=[0.0,1.0]"]),
    "copy-eta-half": ("mask rate: eta ~ U[0.5, 1] per document", "distilled", ["sbd.eta=[0.5,1.0]"]),
}
SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def human_records(distilled: Path, human: Path, tokenizer: str, out: Path) -> Path:
    """The distilled records' prompts with the functions' own bodies (their first as many tokens as the model's
    continuation has) as responses: the same prompts, human targets."""
    from sbd_jax.io.tokenizer import Tokenizer
    if out.exists():
        return out
    tok = Tokenizer.load(tokenizer)
    bodies = [json.loads(x) for x in human.read_text().splitlines() if x.strip()]
    rows = []
    for x in distilled.read_text().splitlines():
        r = json.loads(x)
        n = int(r["id"].lstrip("t"))  # the distilled record of training function n
        body = tok.encode(bodies[n]["response"], add_special_tokens=False)
        rows.append({"id": r["id"], "prompt_ids": r["prompt_ids"], "response_ids": body[:len(r["response_ids"])]})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def evals(run: Path) -> list[dict]:
    f = run / "draft_quality.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def command(args, name: str, data: Path) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "smollm2_copy_lora.yaml"),
            f"model.init_from={args.model}", f"data.tokenizer={args.model}", f"data.path={data}",
            f"draft_eval.path={args.heldout}", f"out_dir={args.out / name}", "steps=100000",
            f"batch_size={args.batch}", "optim.schedule=constant", f"draft_eval.every={args.every}",
            f"draft_eval.rows={args.rows}", f"checkpoint.every={args.every}", "progress=false", "log_every=5",
            *RECIPES[name][2]]


def run_all(args, names: list[str], data: dict[str, Path]) -> None:
    """Runs `names`, `args.parallel` at a time, each stopped once its CPU seconds reach the budget."""
    env = {**os.environ, "XLA_FLAGS": SINGLE_THREAD, "OMP_NUM_THREADS": "1"}
    todo = [n for n in names if not (evals(args.out / n) and evals(args.out / n)[-1]["cpu_seconds"] >= args.budget)]
    live: dict[str, subprocess.Popen] = {}
    while todo or live:
        while todo and len(live) < args.parallel:
            n = todo.pop(0)
            (args.out / n).mkdir(parents=True, exist_ok=True)
            log = (args.out / n / "train.log").open("a")
            live[n] = subprocess.Popen(command(args, n, data[RECIPES[n][1]]), env=env, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=ROOT)
            print(f"{n}: started", flush=True)
        time.sleep(10)
        for n, p in list(live.items()):
            e = evals(args.out / n)
            if e and e[-1]["cpu_seconds"] >= args.budget:
                p.terminate()  # the trainer checkpoints and stops on SIGTERM
                p.wait()
            if p.poll() is not None:
                del live[n]
                done = e and e[-1]["cpu_seconds"] >= args.budget
                print(f"{n}: {'done' if done else f'exited {p.returncode} before the budget'}"
                      f" ({e[-1]['step'] if e else 0} steps)", flush=True)


def export(args, name: str, data: Path) -> Path:
    """The run's adapter at its last checkpoint (<run>/adapter): train.py resumed with `steps` set to that step
    exports it and stops."""
    run = args.out / name
    if not (run / "adapter").is_dir():
        step = max(int(d.name) for d in (run / "checkpoints").iterdir() if d.name.isdigit())
        cmd = [c for c in command(args, name, data) if not c.startswith("steps=")]
        subprocess.run([*cmd, f"steps={step}", "allow_changes=[steps]"], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
    return run / "adapter"


def _lossy_row(r: dict, ar: list) -> dict:
    """A lossy row's scores; `ar_prefix`: the share of the base AR's tokens each output repeats before its first
    difference, averaged over the functions (how far the rule follows AR)."""
    def prefix(out, ref):
        n = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        return n / max(len(ref), 1)
    return {"label": r["label"], "first_line_exact": r["first_line_exact"], "similarity": round(r["similarity"], 4),
            "tokens_per_forward": round(r["tokens_per_forward"], 3),
            "ar_prefix": round(float(np.mean([prefix(o, a) for o, a in zip(r["outputs"], ar)])), 4)}


def lossy(args, names: list[str], data: dict[str, Path]) -> dict:
    """The base model's AR and each run's lossy EB rows (gammas 0.35 and 1, block 16, batch 16) on the first
    `args.lossy` functions of `args.functions`; kept in lossy.json, a rerun adds only what is missing."""
    from demos.real.adapter_eval import settings
    from demos.real.evaluation import evaluate, read_records
    records = read_records(args.functions)[:args.lossy]
    cfg = settings(out_dir=str(args.out), n_heldout=len(records), lossless_policies=(), threshold_gammas=(),
                   latency_n=0)
    path = args.out / "lossy.json"
    done = json.loads(path.read_text()) if path.exists() else {}
    if "base" not in done:
        [r] = evaluate(cfg, {"base": Path(args.model)}, records, [], select=lambda d: d.mode == "ar")
        done["base"] = {"outputs": r["outputs"], "rows": [_lossy_row(r, r["outputs"])]}
    for n in names:
        if n not in done:
            adapter = export(args, n, data[RECIPES[n][1]])
            rows = evaluate(cfg, {"base": Path(args.model), "lora": (Path(args.model), adapter)}, records, [],
                            select=lambda d: d.model == "lora")
            done[n] = {"rows": [_lossy_row(r, done["base"]["outputs"]) for r in rows]}
        path.write_text(json.dumps(done) + "\n")
    return done


def print_lossy(table: dict, names: list[str]) -> None:
    print("\n| recipe | row | first-line exact | similarity | AR's tokens kept before a difference | tokens / forward |"
          "\n|---|---|---:|---:|---:|---:|")
    for n in ["base", *names]:
        for r in table[n]["rows"]:
            print(f"| {n} | {r['label']} | {100 * r['first_line_exact']:.1f}% | {r['similarity']:.3f} | "
                  f"{100 * r['ar_prefix']:.0f}% | {r['tokens_per_forward']:.2f} |")


def at(evals: list[dict], key, t: float) -> float:
    """The metric `key` (a field, or a function of a record) at `t` CPU seconds: each evaluation averaged with its
    neighbours (the metric's noise: +-0.07 on 128 blocks), then interpolated linearly; NaN past the last one."""
    x = [r["cpu_seconds"] for r in evals]
    y = [key(r) if callable(key) else r[key] for r in evals]
    smooth = [sum(y[max(i - 1, 0):i + 2]) / len(y[max(i - 1, 0):i + 2]) for i in range(len(y))]
    if not x or t > x[-1]:
        return float("nan")
    return float(np.interp(t, x, smooth))


def summary(args, names: list[str]) -> list[dict]:
    """Per recipe: the draft metric at half the budget and at the budget, the agreement at offsets 1-3 there, and
    the steps and rows trained by then."""
    rows = []
    for n in names:
        e = evals(args.out / n)
        if not e:
            continue
        cfg = json.loads((args.out / n / "train_config.json").read_text())["train"]
        steps = float(np.interp(args.budget, [r["cpu_seconds"] for r in e], [r["step"] for r in e]))
        rows.append({"recipe": n, "tests": RECIPES[n][0], "steps": round(steps), "rows": round(steps) * cfg["batch_size"],
                     "half": round(at(e, "tokens_per_forward", args.budget / 2), 3),
                     "tokens_per_forward": round(at(e, "tokens_per_forward", args.budget), 3),
                     "agreement_1_3": [round(at(e, lambda r, j=j: r["agreement"][j], args.budget), 3) for j in (1, 2, 3)]})
    return rows


def plot(args, names: list[str], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for n in names:
        e = evals(args.out / n)
        if e:
            ax.plot([r["cpu_seconds"] / 60 for r in e], [r["tokens_per_forward"] for r in e], marker="o", label=n)
    ax.set_xlabel("CPU minutes (all threads of the run; draft metric excluded)")
    ax.set_ylabel("1 + accepted drafts per block (block 16)")
    ax.set_title("Recipe options at equal CPU time (bench/recipe_compare.py)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the base model's HF directory (python -m demos.real_model)")
    ap.add_argument("--distilled", type=Path, required=True, help="training records of the model's continuations")
    ap.add_argument("--heldout", type=Path, required=True, help="held-out distilled records for the draft metric")
    ap.add_argument("--human", type=Path, required=True, help="the training functions (prompt, response) as text")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "recipes")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--budget", type=float, default=2400.0, help="CPU seconds per run")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--every", type=int, default=10, help="steps between draft metric evaluations")
    ap.add_argument("--rows", type=int, default=16, help="held-out records of the draft metric (8 blocks each)")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "recipe_compare.png")
    ap.add_argument("--lossy", type=int, default=0, help="held-out functions decoded by the lossy rows (0: none)")
    ap.add_argument("--functions", type=Path, help="the data stage's heldout.jsonl (for --lossy)")
    args = ap.parse_args(argv)
    if args.lossy and not args.functions:
        ap.error("--lossy needs --functions (the data stage's heldout.jsonl)")
    args.out = args.out.absolute()
    data = {"distilled": args.distilled.absolute(),
            "human": human_records(args.distilled, args.human, args.model, args.out / "data" / "human.jsonl")}
    run_all(args, args.recipes, data)
    rows = summary(args, args.recipes)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(args, args.recipes, args.plot)
    half = f"{args.budget / 2 / 60:.0f}"
    print(f"| recipe | what it tests | steps in {args.budget / 60:.0f} CPU min | 1 + E at {half} CPU min | 1 + E at "
          f"{args.budget / 60:.0f} | agreement at offsets 1, 2, 3 there |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['tests']} | {r['steps']} | {r['half']:.2f} | {r['tokens_per_forward']:.2f} | "
              f"{', '.join(f'{a:.2f}' for a in r['agreement_1_3'])} |")
    if args.lossy:
        print_lossy(lossy(args, args.recipes, data), args.recipes)


if __name__ == "__main__":
    main()
