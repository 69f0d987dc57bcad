"""The demo's evaluation: every decoder runs the held-out problems through the batch runner of decode.py
(sbd_jax/decoding/runner.py), scored by exact match, timed at `eval_batch` rows (throughput) and one
problem at a time (batch 1, the latency-bound setting of the paper's roofline argument)."""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np

from sbd_jax.decoding.prompts import Prompt
from sbd_jax.decoding.results import RowResult, RunSummary
from sbd_jax.decoding.runner import BatchDecoder, DecodeOptions
from sbd_jax.decoding.spec import DecodeSpec
from sbd_jax.io.hf import from_pretrained
from sbd_jax.io.tokenizer import Tokenizer
from . import tasks


@dataclasses.dataclass(frozen=True)
class Decoder:
    label: str
    model: str  # which model: "ntp" | "sbd" (the fine-tunes); the real-model demo adds "base"
    mode: str  # "ar" | "sbd"
    gamma: float | None = None
    rule: str | None = None  # SBD acceptance rule (docs/sbd.md, Inference step 4); None for AR
    verify: bool = False  # lossless: drafts checked against AR's tokens (docs/sbd.md, "Lossless mode")
    policy: str | None = None  # lossless rows: the drafting policy (DecodeSpec.draft_policy); None otherwise
    block_size: int | None = None  # this row's block size (verify mode: its widest draft); None: the config's


# the lossless rows' labels by drafting policy (every policy gives the same tokens: AR's)
POLICY_LABELS = {"adaptive": "adaptive policy", "always": "every call drafting, widest", "never": "never drafting"}


def decoders(cfg) -> list[Decoder]:
    """The baseline, the SBD model decoded AR, the lossless rows, then the lossy rows (the paper's rules)."""
    return [Decoder("NTP fine-tune, AR (baseline)", "ntp", "ar"), Decoder("SBD fine-tune, AR", "sbd", "ar"),
            *sbd_decoders(cfg)]


def sbd_decoders(cfg, name: str = "SBD fine-tune", model: str = "sbd", always_blocks: tuple[int, ...] = ()) -> list[Decoder]:
    """Model `model`'s SBD rows, labelled by `name`: lossless (verify), one per drafting policy of
    `cfg.lossless_policies` (no gamma or rule: they play no part there; "always" once per `always_blocks` when given),
    then the paper's lossy EB rule at `cfg.gammas` and the threshold rule at `cfg.threshold_gammas`."""
    def lossless(p, block=None):
        how = POLICY_LABELS[p] if block is None else f"every call drafting, block {block}"
        return Decoder(f"{name}, lossless (verify, {how})", model, "sbd", verify=True, policy=p, block_size=block)
    out = [lossless(p, b) for p in cfg.lossless_policies for b in (always_blocks if p == "always" and always_blocks
                                                                   else (None,))]
    out += [Decoder(f"{name}, SBD gamma={g:g} (lossy)", model, "sbd", g, "eb") for g in cfg.gammas]
    out += [Decoder(f"{name}, SBD threshold rule gamma={g:g} (lossy)", model, "sbd", g, "threshold")
            for g in cfg.threshold_gammas]
    return out


def problem_prompts(tok: Tokenizer, problems: list[dict]) -> list[Prompt]:
    return [Prompt(i, i + 1, tuple(tok.encode(p["prompt"], add_special_tokens=False))) for i, p in enumerate(problems)]


def suite_width(prompts: list[Prompt]) -> int:
    """The longest prompt of the suite, rounded up to 16 columns."""
    return -(-max(len(p.ids) for p in prompts) // 16) * 16


def batch_decoder(params, mcfg, *, mode: str, block_size: int, gamma, rule, max_new_tokens: int,
                  batch_size: int, prompt_width: int, verify: bool = False,
                  draft_policy: str | None = None, wide_cost: float | None = None) -> BatchDecoder:
    """Greedy decoding; every batch padded to `prompt_width` (the suite's longest prompt), so one compilation
    and a cache no longer than the suite needs. `draft_policy`, `wide_cost`: verify mode's (None: DecodeSpec's
    default)."""
    policy = {"draft_policy": draft_policy} if draft_policy is not None else {}
    spec = DecodeSpec(mode=mode, block_size=block_size, rule=rule or "eb", max_new_tokens=max_new_tokens,
                      verify=verify, wide_cost=wide_cost, **policy)
    return BatchDecoder(params, mcfg, DecodeOptions(spec=spec, gamma=gamma or 0.0, batch_size=batch_size,
                                                    pad_multiple=prompt_width))


def decoder_maker(d: Decoder, params, mcfg, cfg, prompt_width: int):
    """`batch_decoder` for decoder `d` under a demo config (either demo's); call it with `batch_size=`."""
    return functools.partial(batch_decoder, params, mcfg, mode=d.mode, block_size=d.block_size or cfg.block_size,
                             gamma=d.gamma,
                             rule=d.rule, max_new_tokens=cfg.max_new_tokens, verify=d.verify, draft_policy=d.policy,
                             wide_cost=cfg.wide_cost, prompt_width=prompt_width)


def decode_all(dec: BatchDecoder, prompts: list[Prompt], desc: str | None = None) -> tuple[list[RowResult], RunSummary]:
    """-> (per-prompt results in prompt order, the runner's summary); a progress bar when `desc` is given."""
    from tqdm import tqdm
    rows = {}
    with tqdm(total=len(prompts), desc=desc, leave=False, dynamic_ncols=True, disable=desc is None) as progress:
        summary = dec.decode(prompts, lambda p, r: rows.__setitem__(p.id, r), progress)
    return [rows[p.id] for p in prompts], summary


def score(tok: Tokenizer, outputs: list[list[int]], problems: list[dict]) -> list[bool]:
    """Exact match of each decoded row against its problem's answer."""
    return [tasks.extract_answer(tok.decode(out)) == p["answer"] for out, p in zip(outputs, problems)]


def per_family(correct: list[bool], problems: list[dict]) -> dict[str, float]:
    return {f: float(np.mean([c for c, p in zip(correct, problems) if p["family"] == f]))
            for f in sorted({p["family"] for p in problems})}


def run_decoder(d: Decoder, params, mcfg, tok: Tokenizer, problems: list[dict], cfg, progress: bool = True):
    """Decode and score every problem, and time the batch pass and the batch-1 pass of the first `latency_n`
    problems (compilation excluded). Returns (row, retime): `retime()` times both passes again and returns
    (seconds, latency seconds), for the interleaved timing rounds of `evaluate`."""
    prompts = problem_prompts(tok, problems)
    n_lat = min(cfg.latency_n, len(problems))
    make = decoder_maker(d, params, mcfg, cfg, suite_width(prompts))
    batched, single = make(batch_size=cfg.eval_batch), make(batch_size=1)
    rows, s = decode_all(batched, prompts, f"eval {d.label}" if progress else None)
    lat_rows, lat = decode_all(single, prompts[:n_lat], f"batch-1 {d.label}" if progress else None)
    correct = score(tok, [r.tokens for r in rows], problems)
    # rows decoded alone should match the batch (tested exactly in tests/test_decoding.py); float rounding
    # in other batch shapes can still flip a near-tie, so this is recorded, not asserted
    same = [a.tokens == b.tokens for a, b in zip(lat_rows, rows)]

    def retime():
        return batched.decode(prompts).seconds, single.decode(prompts[:n_lat]).seconds

    return {**dataclasses.asdict(d),  # label, model, mode, gamma, rule, verify, policy
            "outputs": [r.tokens for r in rows], "accepted_per_forward": s.accepted.tolist(),
            "accuracy": float(np.mean(correct)), "n": len(problems), "tokens": s.tokens, "nfe": s.nfe,
            "tokens_per_forward": s.tokens_per_forward, "seconds": s.seconds, "timed_tokens": s.tokens,
            "latency_n": n_lat, "latency_seconds": lat.seconds, "latency_timed_tokens": lat.tokens,
            "latency_same_as_batch": float(np.mean(same)) if n_lat else float("nan"),
            "per_family": per_family(correct, problems)}, retime


def evaluate(cfg, models: dict[str, Path], test_file: Path, tok_dir: Path, log=print) -> list[dict]:
    """Every decoder of `decoders(cfg)` on the held-out problems; speedups against the first (the baseline)."""
    tok = Tokenizer.load(tok_dir)
    problems = [json.loads(line) for line in test_file.read_text().splitlines()]
    loaded = {name: from_pretrained(d) for name, d in models.items()}
    rows, retimers = [], []
    for d in decoders(cfg):
        mcfg, params = loaded[d.model]
        r, retime = run_decoder(d, params, mcfg, tok, problems, cfg)
        log(f"[eval] {d.label:34s} acc {100 * r['accuracy']:5.1f}%  tokens/forward {r['tokens_per_forward']:5.2f}")
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
    base, sbd_ar = rows[0], rows[1]
    for r in rows:  # rows with exactly the tokens of the SBD model decoded AR (lossless rows: all, up to near-ties)
        r["same_as_sbd_ar"] = float(np.mean([a == b for a, b in zip(r["outputs"], sbd_ar["outputs"])]))
    for r in rows:
        del r["outputs"]
        r["nfe_speedup"] = r["tokens_per_forward"] / base["tokens_per_forward"]
        r["wall_speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["latency_speedup"] = r["latency_tokens_per_s"] / base["latency_tokens_per_s"]
        r["acc_delta_pts"] = 100 * (r["accuracy"] - base["accuracy"])  # tokens/s: in the table `run` prints
    return rows
