"""The paper's pipeline (Table 1) in miniature, on a CPU:

  data      deterministic task suite (tasks.py) + a BPE tokenizer trained locally (tokenizer.py)
  pretrain  a small Llama-style model trained with NTP on worked solutions
  ft_ntp    fine-tune copy 1: NTP only (the baseline)           } same data, same steps,
  ft_sbd    fine-tune copy 2: SBD dual loss (NTP + MATP)        } same optimizer
  eval      held-out problems: baseline with AR decoding; SBD model with AR and with SBD at several
            gammas (block size 16); accuracy, tokens per forward (NFE speedup) and measured tokens/s,
            all in the same run -> table (markdown + json) and a PNG plot.

Every stage leaves its result in `out_dir` and is skipped when rerun (training stages resume from
their last checkpoint when interrupted).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from ..config import ConfigError, ModelConfig, to_dict
from ..io.hf import from_pretrained
from ..sharding import MeshConfig
from ..training.config import (CheckpointConfig, DataConfig, ModelSource, OptimConfig, SBDConfig,
                               TrainConfig)
from . import tasks
from . import tokenizer as demo_tok


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    out_dir: str = "results"
    seed: int = 0
    # data
    n_pretrain: int = 30000
    n_finetune: int = 30000
    n_test: int = 500
    vocab_size: int = 1024  # BPE trained on the pretraining texts (numbers of <= 3 digits are single tokens)
    # model (Llama-style)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    # training
    seq_len: int = 128
    # fine-tunes: the SBD copy stream holds the responses only (data.copy_len): 80 slots keep the rows as full
    # as 128 (responses are ~56% of the tokens) and cut the SBD step's input from 256 to 208 tokens; the
    # baseline's rows are packed under the same budget, so both fine-tunes see the same rows
    copy_len: int | None = 80
    batch_size: int = 8  # more, smaller SBD updates for the same CPU time (docs/demo_experiments.md)
    pretrain_steps: int = 1200
    finetune_steps: int = 2800  # the SBD fine-tune's length decides the result (docs/demo_experiments.md)
    pretrain_lr: float = 2e-3
    finetune_lr: float = 2e-3
    k_max: int = 16
    train_block_size: int | None = None  # fixed training block size instead of k ~ U[2, k_max] (the paper's)
    # SFT blocks start at the response, as blocks start after the prompt at inference (measured against
    # "document" alignment in README: no clear difference at this scale, slightly better at low gamma)
    block_align: str = "response"
    # evaluation
    block_size: int = 16
    gammas: tuple[float, ...] = (0.1, 0.35, 0.6, 1.0)  # EB rule (the paper's): low 0.1, middle 0.35, high 0.6
    threshold_gammas: tuple[float, ...] = (0.1, 0.35, 0.6)  # the threshold rule (SBD.md step 4), for comparison
    max_new_tokens: int = 48
    eval_batch: int = 100
    latency_n: int = 100  # problems also decoded one at a time (batch 1) for the latency-bound tokens/s
    timing_rounds: int = 3  # every decoder timed this many times, interleaved; tokens/s from the median round

    def __post_init__(self):
        if self.timing_rounds < 1:
            raise ConfigError(f"timing_rounds must be >= 1, got {self.timing_rounds}")

    @classmethod
    def quick(cls, **kw) -> "DemoConfig":
        base = dict(n_pretrain=3000, n_finetune=3000, n_test=64, hidden_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, intermediate_size=192, batch_size=16, pretrain_steps=300,
                    finetune_steps=250, gammas=(0.35, 3.0), threshold_gammas=(0.35,), eval_batch=64,
                    latency_n=16, timing_rounds=2, out_dir="results/quick")
        return cls(**{**base, **kw})


# ----------------------------------------------------------------------------------------------
# stage 1: data


def stage_data(cfg: DemoConfig, log=print) -> dict:
    root = Path(cfg.out_dir) / "data"
    files = {n: root / f"{n}.jsonl" for n in ("pretrain", "finetune", "test")}
    tok_dir = root / "tokenizer"
    spec = {k: getattr(cfg, k) for k in ("seed", "n_pretrain", "n_finetune", "n_test", "vocab_size")}
    if (root / "settings.json").exists():
        check_stage_settings(root, json.loads((root / "settings.json").read_text()), spec)
    if all(f.exists() for f in files.values()) and (tok_dir / "tokenizer.json").exists():
        log(f"[data] reusing {root}")
        return {**files, "tokenizer": tok_dir}
    root.mkdir(parents=True, exist_ok=True)
    (root / "settings.json").write_text(json.dumps(spec))
    sets = {"pretrain": tasks.generate(cfg.n_pretrain, "train", cfg.seed),
            "finetune": tasks.generate(cfg.n_finetune, "train", cfg.seed + 1),
            "test": tasks.generate(cfg.n_test, "test", cfg.seed)}
    tok = demo_tok.build_tokenizer((p.text for p in sets["pretrain"]), cfg.vocab_size)  # training text only
    demo_tok.save(tok, tok_dir)
    for name, probs in sets.items():
        tmp = files[name].with_suffix(".tmp")
        with tmp.open("w") as f:
            for i, p in enumerate(probs):
                rec = ({"text": p.text} if name == "pretrain" else
                       {"id": f"{name}-{i}", "family": p.family, "prompt": p.prompt, "response": p.solution,
                        "answer": p.answer})
                f.write(json.dumps(rec) + "\n")
        tmp.rename(files[name])
    log(f"[data] {len(sets['pretrain'])} pretrain / {len(sets['finetune'])} fine-tune / {len(sets['test'])} "
        f"held-out problems ({', '.join(tasks.FAMILIES)}), tokenizer with {tok.get_vocab_size()} ids -> {root}")
    return {**files, "tokenizer": tok_dir}


# ----------------------------------------------------------------------------------------------
# stages 2-4: training


def model_config(cfg: DemoConfig, tok_dir: Path) -> ModelConfig:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids = demo_tok.special_ids(tok)
    vocab = -(-tok.get_vocab_size() // 8) * 8  # pad the table to a multiple of 8; unused rows are free ids
    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                       num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                       rope_theta=10000.0, max_position_embeddings=512, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, mask_token_id=ids["m"], bos_token_id=ids["bos"],
                       eos_token_id=ids["eos"], pad_token_id=ids["pad"])


def _train_config(cfg: DemoConfig, data_file: Path, tok_dir: Path, *, mode: str, steps: int, lr: float,
                  ntp_only: bool, init_from: str | None, model: ModelConfig | None, out: Path) -> TrainConfig:
    return TrainConfig(
        # the layer loop unrolled (ModelConfig.scan_unroll): faster SBD steps, NTP steps unchanged (BENCHMARKS.md)
        model=ModelSource(init_from=init_from, config=model, scan_unroll=cfg.num_layers),
        data=DataConfig(path=str(data_file), mode=mode, tokenizer=str(tok_dir), seq_len=cfg.seq_len,
                        seed=cfg.seed, chat_template=False, copy_len=cfg.copy_len if mode == "sft" else None),
        sbd=SBDConfig(k_max=cfg.k_max, block_size=cfg.train_block_size, ntp_only=ntp_only,
                      block_align=cfg.block_align if mode == "sft" else "document"),
        optim=OptimConfig(lr=lr, warmup_steps=max(1, steps // 20), schedule="cosine", weight_decay=0.01),
        checkpoint=CheckpointConfig(every=max(1, steps // 4), keep=2, async_save=False),
        mesh=MeshConfig(data=1), out_dir=str(out), steps=steps, batch_size=cfg.batch_size, seed=cfg.seed,
        log_every=10)


# where a stage's saved settings may differ from this run's without making its result stale (paths, and the
# layer loop's unrolling, which changes speed only)
_NEUTRAL_KEYS = {"out_dir", "model.init_from", "data.path", "data.tokenizer", "model.scan_unroll"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_stage_settings(stage_dir: Path, saved: dict, wanted: dict) -> None:
    """Refuse to reuse or resume a stage whose saved settings differ from this run's (a rerun with
    `finetune_steps=4000` must not silently reuse a 2000-step model): ConfigError naming every difference."""
    old, new = _flat(saved), _flat(json.loads(json.dumps(wanted, default=str)))  # saved: read from JSON already
    diff = sorted(k for k in old.keys() | new.keys() if k not in _NEUTRAL_KEYS and old.get(k) != new.get(k))
    if diff:
        detail = ", ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in diff)
        raise ConfigError(f"{stage_dir} was made with other settings ({detail}); pass a new --out directory or "
                          f"delete {stage_dir} to redo that stage")


def stage_train(name: str, tcfg: TrainConfig, log=print) -> Path:
    """Run (or resume, or skip) one training stage; returns its HF export directory."""
    from ..training import train
    out = Path(tcfg.out_dir)
    hf = out / "hf"
    saved = out / "train_config.json"
    if saved.exists():
        check_stage_settings(out, json.loads(saved.read_text())["train"], to_dict(tcfg))
    if (out / "DONE").exists() and (hf / "config.json").exists():
        log(f"[{name}] reusing {hf}")
        return hf
    log(f"[{name}] {'NTP only' if tcfg.sbd.ntp_only else 'SBD dual loss'}, {tcfg.steps} steps -> {out}")
    t0 = time.time()
    result = train(tcfg)
    if result.hf_dir is None:
        raise RuntimeError(f"[{name}] training ended without an HF export")
    last = result.history[-1] if result.history else {}
    (out / "DONE").write_text(json.dumps({"seconds": time.time() - t0, "last": last}, default=float))
    log(f"[{name}] done in {time.time() - t0:.0f}s: " +
        ", ".join(f"{k}={last[k]:.3f}" for k in ("loss", "ntp_loss", "matp_loss") if k in last and last[k] is not None))
    return result.hf_dir


# ----------------------------------------------------------------------------------------------
# stage 5: evaluation


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    label: str
    model: str  # "ntp" | "sbd"
    mode: str  # "ar" | "sbd"
    gamma: float | None = None
    rule: str | None = None  # SBD acceptance rule (SBD.md step 4); None for AR


def decoder_specs(cfg: DemoConfig) -> list[DecoderSpec]:
    specs = [DecoderSpec("NTP fine-tune, AR (baseline)", "ntp", "ar"),
             DecoderSpec("SBD fine-tune, AR", "sbd", "ar")]
    specs += [DecoderSpec(f"SBD fine-tune, SBD gamma={g:g}", "sbd", "sbd", g, "eb") for g in cfg.gammas]
    specs += [DecoderSpec(f"SBD fine-tune, SBD threshold rule gamma={g:g}", "sbd", "sbd", g, "threshold")
              for g in cfg.threshold_gammas]
    return specs


def _encode_prompts(tok, problems: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    ids = [tok.encode(p["prompt"], add_special_tokens=False).ids for p in problems]
    P = max(len(x) for x in ids)
    arr = np.zeros((len(ids), P), np.int32)
    for i, x in enumerate(ids):
        arr[i, : len(x)] = x
    return arr, np.array([len(x) for x in ids], np.int32)


def run_decoder(spec: DecoderSpec, params, mcfg: ModelConfig, tok, problems: list[dict], cfg: DemoConfig,
                progress=True):
    """Decode every problem (batches of `eval_batch`, one compiled shape), exact-match score, and time it
    twice: the full pass at `eval_batch` rows (throughput) and the first `latency_n` problems one at a time
    (batch 1, the latency-bound setting of the paper's roofline argument). Each timing follows an untimed
    compiling call of its shape. Returns (row, retime): `retime()` times both passes again and returns
    (seconds, latency seconds), for the interleaved timing rounds of `stage_eval`."""
    from ..decoding import generate
    prompts, lengths = _encode_prompts(tok, problems)
    nb = -(-len(problems) // cfg.eval_batch)
    pad_rows = nb * cfg.eval_batch - len(problems)
    prompts = np.concatenate([prompts, np.repeat(prompts[:1], pad_rows, 0)])
    lengths = np.concatenate([lengths, np.repeat(lengths[:1], pad_rows, 0)])

    def call(sl):
        return generate(params, mcfg, prompts[sl], lengths[sl], max_new_tokens=cfg.max_new_tokens,
                        block_size=cfg.block_size, gamma=spec.gamma if spec.gamma is not None else 0.0,
                        rule=spec.rule or "eb", temperature=0.0, mode=spec.mode)

    def timed_pass(slices, desc):
        jax.block_until_ready(call(slices[0]))  # compile
        it = slices
        if progress:
            from tqdm import tqdm
            it = tqdm(slices, desc=desc, leave=False, dynamic_ncols=True)
        t0 = time.perf_counter()
        outs = [jax.device_get(call(sl)) for sl in it]
        return outs, time.perf_counter() - t0

    outs, seconds = timed_pass([slice(b * cfg.eval_batch, (b + 1) * cfg.eval_batch) for b in range(nb)],
                               f"eval {spec.label}")
    toks = np.concatenate([o.tokens for o in outs])[: len(problems)]
    lens = np.concatenate([o.lengths for o in outs])[: len(problems)]
    nfe = np.concatenate([o.nfe for o in outs])[: len(problems)]
    correct = score(tok, toks, lens, problems)
    gen_all = int(np.concatenate([o.lengths for o in outs]).sum())  # tokens actually produced, incl. pad rows
    n_lat = min(cfg.latency_n, len(problems))
    lat_outs, lat_seconds = timed_pass([slice(i, i + 1) for i in range(n_lat)], f"batch-1 {spec.label}")
    # rows decoded alone should match the batch (tested exactly in tests/test_decoding.py); float rounding
    # in other batch shapes can still flip a near-tie, so this is recorded, not asserted
    same = [np.array_equal(o.tokens[0], toks[i]) for i, o in enumerate(lat_outs)]
    batch_slices = [slice(b * cfg.eval_batch, (b + 1) * cfg.eval_batch) for b in range(nb)]

    def retime():
        def once(slices):
            t0 = time.perf_counter()
            for sl in slices:
                jax.device_get(call(sl))
            return time.perf_counter() - t0
        return once(batch_slices), once([slice(i, i + 1) for i in range(n_lat)])

    return {"label": spec.label, "model": spec.model, "mode": spec.mode, "gamma": spec.gamma, "rule": spec.rule,
            "accuracy": float(np.mean(correct)), "n": len(problems),
            "tokens": int(lens.sum()), "nfe": int(nfe.sum()),
            "tokens_per_forward": float(lens.sum() / max(nfe.sum(), 1)),
            "seconds": seconds, "tokens_per_s": gen_all / seconds, "timed_tokens": gen_all,
            "latency_n": n_lat, "latency_seconds": lat_seconds, "latency_timed_tokens": int(lens[:n_lat].sum()),
            "latency_tokens_per_s": float(lens[:n_lat].sum() / lat_seconds) if n_lat else float("nan"),
            "latency_same_as_batch": float(np.mean(same)) if n_lat else float("nan"),
            "per_family": per_family(correct, problems)}, retime


def score(tok, tokens_BN, lengths_B, problems: list[dict]) -> list[bool]:
    """Exact match of each decoded row (first `lengths[b]` tokens) against its problem's answer."""
    return [tasks.extract_answer(tok.decode(tokens_BN[i, : lengths_B[i]].tolist(), skip_special_tokens=True))
            == p["answer"] for i, p in enumerate(problems)]


def per_family(correct: list[bool], problems: list[dict]) -> dict[str, float]:
    return {f: float(np.mean([c for c, p in zip(correct, problems) if p["family"] == f]))
            for f in sorted({p["family"] for p in problems})}


def stage_eval(cfg: DemoConfig, models: dict[str, Path], test_file: Path, tok_dir: Path, log=print) -> list[dict]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    problems = [json.loads(line) for line in test_file.read_text().splitlines()]
    loaded = {name: from_pretrained(d) for name, d in models.items()}
    rows, retimers = [], []
    for spec in decoder_specs(cfg):
        mcfg, params = loaded[spec.model]
        r, retime = run_decoder(spec, params, mcfg, tok, problems, cfg)
        log(f"[eval] {spec.label:34s} acc {100 * r['accuracy']:5.1f}%  tokens/forward {r['tokens_per_forward']:5.2f}"
            f"  {r['tokens_per_s']:8.0f} tokens/s (batch {cfg.eval_batch})  {r['latency_tokens_per_s']:6.0f} tokens/s "
            f"(batch 1)")
        rows.append(r)
        retimers.append(retime)
    # more timing rounds, every decoder once per round (a slow spell of a shared machine then hits all of
    # them alike); each decoder's tokens/s is taken from its median round
    times = [([r["seconds"]], [r["latency_seconds"]]) for r in rows]
    for i in range(1, cfg.timing_rounds):
        log(f"[eval] timing round {i + 1}/{cfg.timing_rounds}")
        for (batch_s, lat_s), retime in zip(times, retimers):
            b, lat = retime()
            batch_s.append(b)
            lat_s.append(lat)
    for r, (batch_s, lat_s) in zip(rows, times):
        r["seconds"], r["latency_seconds"] = float(np.median(batch_s)), float(np.median(lat_s))
        r["tokens_per_s"] = r["timed_tokens"] / r["seconds"]
        r["latency_tokens_per_s"] = r["latency_timed_tokens"] / r["latency_seconds"] if r["latency_n"] else float("nan")
        r["seconds_rounds"], r["latency_seconds_rounds"] = batch_s, lat_s
    base = rows[0]
    for r in rows:
        r["nfe_speedup"] = r["tokens_per_forward"] / base["tokens_per_forward"]
        r["wall_speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["latency_speedup"] = r["latency_tokens_per_s"] / base["latency_tokens_per_s"]
        r["acc_delta_pts"] = 100 * (r["accuracy"] - base["accuracy"])
    return rows


# ----------------------------------------------------------------------------------------------
# report


def markdown_table(rows: list[dict], eval_batch: int) -> str:
    head = ("| model, decoding | accuracy | Δ vs baseline | tokens / forward | NFE speedup "
            f"| tokens/s, batch {eval_batch} | wall-clock speedup, batch {eval_batch} | tokens/s, batch 1 "
            "| wall-clock speedup, batch 1 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    body = "".join(
        f"| {r['label']} | {100 * r['accuracy']:.1f}% | {r['acc_delta_pts']:+.1f} pts | {r['tokens_per_forward']:.2f} "
        f"| {r['nfe_speedup']:.2f}x | {r['tokens_per_s']:.0f} | {r['wall_speedup']:.2f}x "
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
        for rule, color, name in (("eb", "C1", "SBD, EB rule (gamma sweep)"),
                                  ("threshold", "C3", "SBD, threshold rule (gamma sweep)")):
            sbd = [r for r in rows if r["mode"] == "sbd" and r["rule"] == rule]
            if not sbd:
                continue
            ax.plot([r[key] for r in sbd], [100 * r["accuracy"] for r in sbd], "o-", color=color, label=name)
            for r in sbd:
                ax.annotate(f"γ={r['gamma']:g}", (r[key], 100 * r["accuracy"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=8, color=color)
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def run(cfg: DemoConfig, log=print) -> list[dict]:
    out = Path(cfg.out_dir).absolute()
    cfg = dataclasses.replace(cfg, out_dir=str(out))
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    t0 = time.time()
    files = stage_data(cfg, log)
    base_model = model_config(cfg, files["tokenizer"])
    pre = stage_train("pretrain", _train_config(cfg, files["pretrain"], files["tokenizer"], mode="text",
                                                steps=cfg.pretrain_steps, lr=cfg.pretrain_lr, ntp_only=True,
                                                init_from=None, model=base_model, out=out / "pretrain"), log)
    models = {}
    for name, ntp_only in (("ntp", True), ("sbd", False)):
        models[name] = stage_train(f"ft_{name}", _train_config(
            cfg, files["finetune"], files["tokenizer"], mode="sft", steps=cfg.finetune_steps, lr=cfg.finetune_lr,
            ntp_only=ntp_only, init_from=str(pre), model=None, out=out / f"ft_{name}"), log)
    res_file = out / "results.json"
    prev = json.loads(res_file.read_text()) if res_file.exists() else None
    if prev is not None and prev.get("config") == json.loads(json.dumps(dataclasses.asdict(cfg))):
        log(f"[eval] reusing {res_file}")
        rows = prev["rows"]
    else:
        rows = stage_eval(cfg, models, files["test"], files["tokenizer"], log)
    table = markdown_table(rows, cfg.eval_batch) + "\nAccuracy per task family:\n\n" + family_table(rows)
    _write_atomic(out / "table.md", table)
    _write_atomic(res_file, json.dumps({"config": dataclasses.asdict(cfg), "rows": rows,
                                        "device": str(jax.devices()[0].device_kind),
                                        "total_seconds": time.time() - t0}, indent=2))
    plot(rows, out / "accuracy_vs_speedup.png", cfg.eval_batch)
    log("\n" + table)
    log(f"table: {out / 'table.md'}  json: {out / 'results.json'}  plot: {out / 'accuracy_vs_speedup.png'}  "
        f"({time.time() - t0:.0f}s)")
    return rows
