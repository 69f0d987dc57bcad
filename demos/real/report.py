"""The real-model demo's report: the results table (markdown) and the speed/quality plot."""
from __future__ import annotations

from pathlib import Path

from ..toy.report import lossless_points


def markdown_table(rows: list[dict], eval_batch: int) -> str:
    head = ("| model, decoding | first-line exact | Δ vs NTP fine-tune | body similarity | parses | HumanEval pass@1 "
            "| rows = same model's AR | tokens / forward | NFE speedup "
            f"| tokens/s, batch {eval_batch} | speedup, batch {eval_batch} | tokens/s, batch 1 | speedup, batch 1 |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    body = "".join(
        f"| {r['label']} | {100 * r['first_line_exact']:.1f}% | {r['first_line_delta_pts']:+.1f} pts "
        f"| {r['similarity']:.3f} | {100 * r['parses']:.0f}% | {100 * r['humaneval_pass1']:.1f}% "
        f"| {100 * r['same_as_ar']:.0f}% | {r['tokens_per_forward']:.2f} | {r['nfe_speedup']:.2f}x "
        f"| {r['tokens_per_s']:.0f} | {r['wall_speedup']:.2f}x | {r['latency_tokens_per_s']:.0f} "
        f"| {r['latency_speedup']:.2f}x |\n" for r in rows)
    return head + body


def acceptance_table(rows: list[dict]) -> str:
    """Per SBD row: the share of model calls that decoded 0, 1, 2, ... tokens per row (the acceptance histogram,
    summed over rows and calls of the batch pass)."""
    sbd = [r for r in rows if r["mode"] == "sbd" and r.get("accepted_per_forward")]
    if not sbd:
        return ""
    width = max(len(r["accepted_per_forward"]) for r in sbd)
    head = ("Model calls by tokens decoded per row (share of calls, batch pass):\n\n| row | "
            + " | ".join(str(i) for i in range(width)) + " |\n|---|" + "---:|" * width + "\n")
    body = ""
    for r in sbd:
        hist = list(r["accepted_per_forward"]) + [0] * (width - len(r["accepted_per_forward"]))
        total = sum(hist) or 1
        body += f"| {r['label']} | " + " | ".join(f"{100 * h / total:.1f}%" for h in hist) + " |\n"
    return head + body


def plot(rows: list[dict], path: Path) -> None:
    """First-line exact match against tokens per forward: one line per lossy rule (gamma sweep), the lossless
    rows as points labelled by drafting policy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lossy = [(model, rule) for model in ("sbd", "lora") for rule in ("eb", "threshold")]
    styles = {"sbd": ("o-", "SBD"), "lora": ("x--", "SBD LoRA")}
    colors = {"eb": ("C1", "EB rule (lossy)"), "threshold": ("C3", "threshold rule (lossy)")}
    for model, rule in lossy:
        pts = [r for r in rows if r["model"] == model and r["mode"] == "sbd" and not r["verify"] and r["rule"] == rule]
        if pts:
            (style, who), (color, name) = styles[model], colors[rule]
            ax.plot([r["nfe_speedup"] for r in pts], [100 * r["first_line_exact"] for r in pts], style, color=color,
                    label=f"{who}, {name}")
            for r in pts:
                ax.annotate(f"γ={r['gamma']:g}", (r["nfe_speedup"], 100 * r["first_line_exact"]),
                            textcoords="offset points", xytext=(4, 4), fontsize=8, color=color)
    lossless_points(ax, [r for r in rows if r["verify"]], "nfe_speedup", "first_line_exact")
    for r, marker in zip([r for r in rows if r["mode"] == "ar"], ("s", "D", "^", "v")):
        ax.plot([r["nfe_speedup"]], [100 * r["first_line_exact"]], marker, label=r["label"])
    ax.set_xlabel("speedup in forward passes (NFE) over the NTP fine-tune")
    ax.set_ylabel("held-out first-line exact match (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("SBD on a real model: completing held-out stdlib functions (block size 16)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
