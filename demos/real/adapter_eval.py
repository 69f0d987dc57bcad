"""An SBD adapter on the base model, scored on held-out stdlib functions through the demo's evaluation
(evaluation.py: decode.py's batch runner, greedy, block 16): the base's AR, then the adapter's lossless (verify)
rows and the lossy EB / threshold rows, each with first-line exact, similarity, its share of completions equal to
the base's AR, tokens per forward and tokens/s at `eval_batch` rows and at batch 1, and ratios to the base's AR.
bench/eval_real.py makes a table with it; `make demo-real-eval` (reproduce.py) decodes a committed adapter's
recorded table again."""
from __future__ import annotations

from pathlib import Path

from .config import RealDemoConfig
from .evaluation import evaluate
from .metrics import identical_share


def settings(**kw) -> RealDemoConfig:
    """The evaluation's settings: greedy, block 16, 192-token prompts, 128 new tokens, the lossless policies adaptive
    and always (at blocks 2 and 4: a CPU's affordable widths), EB and the threshold rule at gammas 0.35 and 1, batch 16, 8
    prompts timed one at a time; `kw` overrides."""
    base = dict(prompt_tokens=192, max_new_tokens=128, lossless_policies=("adaptive", "always"), always_blocks=(2, 4),
                gammas=(0.35, 1.0), threshold_gammas=(0.35, 1.0), eval_batch=16, latency_n=8, latency_lossy=False)
    return RealDemoConfig(**{**base, **kw})


def evaluate_adapter(cfg: RealDemoConfig, base: Path, adapter: Path, records: list[dict], log=print, on_row=None,
                     select=None, humaneval: list[dict] = ()) -> list[dict]:
    """The rows (outputs kept: token ids per function, then per HumanEval problem) on `records` (held-out records
    with "prompt_ids") and `humaneval` (its records, each program checked in the sandbox); `select`
    keeps decoders (demos/toy/evaluation.py `Decoder`) as evaluate's does. The adapter's own AR row is left out:
    a copy-only adapter's AR is the base's (tests/test_draft_recipe.py)."""
    rows = evaluate(cfg, {"base": base, "lora": (base, Path(adapter))}, records, list(humaneval), log, on_row=on_row,
                    select=select)
    ar = next((r for r in rows if r["model"] == "base"), None)
    for r in rows:
        r["same_as_base_ar"] = identical_share(r["outputs"], ar["outputs"]) if ar else float("nan")
    return rows


def table(rows: list[dict], batch: int) -> str:
    """Markdown: one line per row, ratios to the base model's AR row (`batch`: the rows decoded at once; batch 1:
    the prompts timed one at a time, with their own tokens per forward, which verify mode's policy sets per batch);
    HumanEval pass@1 when problems were decoded."""
    ar = next(r for r in rows if r["model"] == "base")
    he = any(r.get("n_humaneval") for r in rows)
    head = (f"| decoding | first-line exact | similarity |{' HumanEval pass@1 |' if he else ''} = base AR | "
            f"tokens / forward | tokens/s, batch {batch} | ratio | tokens / forward, batch 1 | tokens/s, batch 1 | "
            f"ratio |\n|---|---:|---:|{'---:|' if he else ''}---:|---:|---:|---:|---:|---:|---:|\n")
    out = []
    for r in rows:
        lat, ref = r["latency_tokens_per_s"], ar["latency_tokens_per_s"]
        out.append(f"| {r['label']} | {100 * r['first_line_exact']:.1f}% | {r['similarity']:.3f} | "
                   + (f"{100 * r['humaneval_pass1']:.1f}% | " if he else "")
                   + f"{100 * r['same_as_base_ar']:.0f}% | {r['tokens_per_forward']:.2f} | {r['tokens_per_s']:.0f} | "
                   f"{r['tokens_per_s'] / ar['tokens_per_s']:.2f}x | "
                   + (f"{r.get('latency_tokens_per_forward', float('nan')):.2f} | {lat:.1f} | {lat / ref:.2f}x |"
                      if lat == lat else "| | |"))
    return head + "\n".join(out) + "\n"
