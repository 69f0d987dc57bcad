"""The demo's report: the results table (markdown), accuracy per task family, the accuracy-vs-speedup plot."""
from __future__ import annotations

from pathlib import Path


def markdown_table(rows: list[dict], eval_batch: int) -> str:
    head = ("| model, decoding | accuracy | Δ vs baseline | rows = SBD model's AR | tokens / forward | NFE speedup "
            f"| tokens/s, batch {eval_batch} | wall-clock speedup, batch {eval_batch} | tokens/s, batch 1 "
            "| wall-clock speedup, batch 1 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    body = "".join(
        f"| {r['label']} | {100 * r['accuracy']:.1f}% | {r['acc_delta_pts']:+.1f} pts | {100 * r['same_as_sbd_ar']:.0f}% "
        f"| {r['tokens_per_forward']:.2f} | {r['nfe_speedup']:.2f}x | {r['tokens_per_s']:.0f} | {r['wall_speedup']:.2f}x "
        f"| {r['latency_tokens_per_s']:.0f} | {r['latency_speedup']:.2f}x |\n" for r in rows)
    return head + body


def family_table(rows: list[dict]) -> str:
    """Exact-match accuracy per task family (same rows as `markdown_table`)."""
    fams = sorted(rows[0]["per_family"])
    head = "| model, decoding | " + " | ".join(fams) + " |\n|---|" + "---:|" * len(fams) + "\n"
    return head + "".join(f"| {r['label']} | " + " | ".join(f"{100 * r['per_family'][f]:.0f}%" for f in fams) + " |\n"
                          for r in rows)


def plot(rows: list[dict], path: Path, eval_batch: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, xlabel in ((axes[0], "nfe_speedup", "speedup in forward passes (NFE)"),
                            (axes[1], "latency_speedup", "measured wall-clock speedup, batch 1 (CPU)"),
                            (axes[2], "wall_speedup", f"measured wall-clock speedup, batch {eval_batch} (CPU)")):
        for rule, color, name in (("eb", "C1", "SBD, EB rule (gamma sweep; lossy)"),
                                  ("threshold", "C3", "SBD, threshold rule (gamma sweep; lossy)")):
            sbd = [r for r in rows if r["mode"] == "sbd" and not r.get("verify") and r["rule"] == rule]
            if not sbd:
                continue
            ax.plot([r[key] for r in sbd], [100 * r["accuracy"] for r in sbd], "o-", color=color, label=name)
            for r in sbd:
                ax.annotate(f"γ={r['gamma']:g}", (r[key], 100 * r["accuracy"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=8, color=color)
        lossless_points(ax, [r for r in rows if r.get("verify")], key, "accuracy")
        for r, c, m in ((rows[0], "C0", "s"), (rows[1], "C2", "^")):
            ax.plot([r[key]], [100 * r["accuracy"]], m, color=c, label=r["label"])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("exact-match accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("Set Block Decoding in miniature: accuracy vs speedup (block size 16)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def lossless_points(ax, rows: list[dict], key: str, metric: str) -> None:
    """The lossless (verify) rows as unjoined points, each labelled by its drafting policy (they share AR's
    tokens, so only the speed differs); used by both demos' plots."""
    if not rows:
        return
    ax.plot([r[key] for r in rows], [100 * r[metric] for r in rows], "*", markersize=10, color="C4",
            label="SBD lossless (verify; one point per drafting policy)")
    for r in rows:
        ax.annotate(r["policy"], (r[key], 100 * r[metric]), textcoords="offset points",
                    xytext=(4, -10), fontsize=8, color="C4")


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
