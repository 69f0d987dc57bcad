"""Draft quality in one forward per sequence: how much of each block lossless (verify) decoding would keep.

Input: held-out prompts with the model's own greedy AR continuation `a` ({"prompt_ids", "response_ids"} records,
e.g. sbd_jax/training/distill.py's). The SBD training layout already gives every block its all-masked draft given
the exact prefix: clean stream = prompt + a, copy stream = a with every token `<m>`, blocks of k aligned to the
continuation's start. One forward; the draft at each copy position is the argmax of its logits (`<m>` never drawn).

Reported (`DraftQuality`):
  agreement[j]  share of blocks whose draft at offset j equals a (offset 0 is the block's first position)
  accepted      mean over blocks of the agreeing prefix of offsets 1, 2, ... (offset 0 is AR's own token in verify
                mode: the clean query of the previous block's last position gives it), i.e. the drafts a forward
                that checks a whole block keeps; 1 + accepted is the tokens per forward of a decoder in which
                every forward verifies one block and drafts the next
  ar_agreement  share of positions where the model's own AR token (the clean stream's argmax) equals a: 1.0 when a
                is this model's greedy output (always, for a copy-only adapter on the base that wrote a)
Only whole blocks inside the continuation count.

`1 + accepted` averages over blocks at fixed starts; a decoder's blocks start where the previous check stopped, so
its calls crowd where drafts fail (a stretch keeping 1 + m tokens a call takes 1 / (1 + m) calls per token) and it
makes fewer tokens per call than that mean (SmolLM2's copy-only adapter, k 4 / 8: 2.35 / 2.41 against 2.08 / 2.07
decoded). `chained_tokens_per_forward` replays the decoder's own sequence of blocks from the drafts of
every block start (k forwards, one per block alignment), and equals what lossless decoding with every call drafting
at width k measures, call for call.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..attention import clean_meta, concat_meta, copy_meta
from ..config import ConfigError
from ..models.config import ModelConfig
from ..models.transformer import forward, lm_head


class DraftQuality(NamedTuple):
    agreement: np.ndarray  # [k] per block offset
    accepted: float  # mean agreeing prefix of offsets 1.. per block
    accepted_hist: np.ndarray  # [k] blocks by accepted prefix 0..k-1
    ar_agreement: float
    blocks: int

    def as_dict(self) -> dict:
        return {"accepted": round(self.accepted, 4), "tokens_per_forward": round(1.0 + self.accepted, 4),
                "agreement": [round(float(x), 4) for x in self.agreement], "ar_agreement": round(self.ar_agreement, 4),
                "accepted_hist": self.accepted_hist.tolist(), "blocks": self.blocks}


class DraftSet(NamedTuple):
    """Held-out sequences laid out for the metric: prompts left-truncated to `prompt_len`, continuations cut to
    `cont_len`, right-padded (numpy)."""

    tokens: np.ndarray  # [B, P + C] clean: prompt then continuation
    prompt_lengths: np.ndarray  # [B]
    cont_lengths: np.ndarray  # [B]
    prompt_len: int
    cont_len: int


def load_draft_set(path: str | Path, *, rows: int, prompt_len: int, cont_len: int) -> DraftSet:
    """The first `rows` records of a {"prompt_ids", "response_ids"} JSON-lines file (distill.py's format)."""
    toks, pls, cls = [], [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if len(toks) == rows:
                break
            if not line.strip():
                continue
            r = json.loads(line)
            p, a = r.get("prompt_ids"), r.get("response_ids")
            if not (isinstance(p, list) and isinstance(a, list) and p and a):
                raise ConfigError(f"{str(path)!r} line {n}: needs non-empty \"prompt_ids\" and \"response_ids\"")
            p, a = p[-prompt_len:], a[:cont_len]
            row = np.zeros(prompt_len + cont_len, np.int32)
            row[:len(p)], row[len(p):len(p) + len(a)] = p, a
            toks.append(row)
            pls.append(len(p))
            cls.append(len(a))
    if not toks:
        raise ConfigError(f"{str(path)!r} holds no records")
    return DraftSet(np.stack(toks), np.array(pls, np.int32), np.array(cls, np.int32), prompt_len, cont_len)


def layout(ds: DraftSet, block_size: int, mask_token_id: int, align: int = 0):
    """-> (tokens [B, T + T], meta): [clean ; copy] with the copy stream every continuation token from offset `align`
    on masked, blocks of `block_size` from there; prompts (and the first `align` continuation tokens) are clean only
    (copy segment 0)."""
    B, T = ds.tokens.shape
    col = np.arange(T)[None]
    total = ds.prompt_lengths + ds.cont_lengths
    seg = (col < total[:, None]).astype(np.int32)
    start = ds.prompt_lengths[:, None] + align
    in_cont = (col >= start) & (seg > 0)
    block = start + ((col - start) // block_size) * block_size
    copy_tok = np.where(in_cont, mask_token_id, 0).astype(np.int32)
    meta = concat_meta(clean_meta(seg, np.broadcast_to(col, (B, T))),
                       copy_meta(in_cont.astype(np.int32), np.broadcast_to(col, (B, T)), np.where(in_cont, block, 0)))
    return np.concatenate([ds.tokens, copy_tok], axis=1), meta


def predictions(params, cfg: ModelConfig, tokens, meta, T: int):
    """-> (drafts [B, T]: argmax of each copy position, `<m>` excluded; AR [B, T]: the clean stream's argmax at
    column i - 1 placed at column i, i.e. the model's own token for column i)."""
    h, _ = forward(params, cfg, tokens, meta, return_hidden=True, clean_prefix=T)
    logits = lm_head(params, cfg, h)
    if cfg.mask_token_id is not None:
        logits = logits.at[..., cfg.mask_token_id].set(-jnp.inf)
    top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    ar = jnp.concatenate([jnp.zeros_like(top[:, :1]), top[:, :T - 1]], axis=1)
    return top[:, T:], ar


_predictions = jax.jit(predictions, static_argnums=(1, 4))


def score(ds: DraftSet, drafts: np.ndarray, ar: np.ndarray, block_size: int) -> DraftQuality:
    """The report from the drafts and AR tokens of each continuation column (host side)."""
    k = block_size
    agree_sum, hist = np.zeros(k), np.zeros(k, np.int64)
    acc_total, blocks, ar_hits, ar_n = 0, 0, 0, 0
    for r in range(ds.tokens.shape[0]):
        p, c = int(ds.prompt_lengths[r]), int(ds.cont_lengths[r])
        a = ds.tokens[r, p:p + c]
        ar_hits += int(np.sum(ar[r, p:p + c] == a))
        ar_n += c
        for b in range(0, c - k + 1, k):
            ok = drafts[r, p + b:p + b + k] == a[b:b + k]
            agree_sum += ok
            m = int(np.argmin(np.append(ok[1:], False)))  # the agreeing prefix of offsets 1..
            acc_total += m
            hist[m] += 1
            blocks += 1
    n = max(blocks, 1)
    return DraftQuality(agree_sum / n, acc_total / n, hist, ar_hits / max(ar_n, 1), blocks)


def block_drafts(params, cfg: ModelConfig, ds: DraftSet, block_size: int, align: int = 0):
    """One forward -> (drafts [B, T] of the blocks starting at continuation offset `align` + j * block_size, the
    model's AR tokens [B, T]) (`layout`, `predictions`)."""
    if cfg.mask_token_id is None:
        raise ConfigError("draft quality needs the model's mask token (mask_token_id)")
    tokens, meta = layout(ds, block_size, cfg.mask_token_id, align)
    drafts, ar = jax.device_get(_predictions(params, cfg, jnp.asarray(tokens), jax.tree.map(jnp.asarray, meta),
                                             ds.tokens.shape[1]))
    return np.asarray(drafts), np.asarray(ar)


def draft_quality(params, cfg: ModelConfig, ds: DraftSet, block_size: int) -> DraftQuality:
    """One forward over `ds` (all rows at once) -> the report."""
    drafts, ar = block_drafts(params, cfg, ds, block_size)
    return score(ds, drafts, ar, block_size)


def chain_calls(ds: DraftSet, drafts_by_align: list[np.ndarray], block_size: int) -> np.ndarray:
    """[B] the calls lossless decoding takes per continuation when every call checks a whole block and drafts the
    next (verify mode, draft width k = block_size, no stop token): the first call gives the continuation's first
    token and drafts its block; each later call keeps the agreeing prefix m of the block's k - 1 drafts (those
    within the continuation) and AR's token after them, where the next block starts. `drafts_by_align[r]`: the
    drafts of blocks starting at continuation offsets = r mod k (`layout(..., align=r)`)."""
    k, calls = block_size, np.zeros(ds.tokens.shape[0], np.int64)
    for r in range(ds.tokens.shape[0]):
        p, c = int(ds.prompt_lengths[r]), int(ds.cont_lengths[r])
        a, s, n_calls = ds.tokens[r, p:p + c], 0, 1
        while s + 1 < c:
            n = min(k - 1, c - 1 - s)
            ok = drafts_by_align[s % k][r, p + s + 1:p + s + 1 + n] == a[s + 1:s + 1 + n]
            s += int(np.argmin(np.append(ok, False))) + 1
            n_calls += 1
        calls[r] = n_calls
    return calls


def chained_tokens_per_forward(params, cfg: ModelConfig, ds: DraftSet, block_size: int) -> float:
    """Tokens per call of lossless decoding at draft width `block_size` on `ds`'s continuations (`chain_calls`):
    k forwards over `ds`, one per block alignment."""
    drafts = [block_drafts(params, cfg, ds, block_size, r)[0] for r in range(block_size)]
    return float(np.sum(ds.cont_lengths) / np.sum(chain_calls(ds, drafts, block_size)))


class DraftEval:
    """The training loop's periodic metric (TrainConfig.draft_eval): <out_dir>/draft_quality.jsonl, one record per
    evaluated step with the training seconds so far, wall and CPU (every thread of the process: the fair clock when
    runs share a machine); its own time excluded; a resumed run continues the count of the records it keeps."""

    FILE = "draft_quality.jsonl"

    def __init__(self, cfg, model_cfg: ModelConfig, out_dir: Path, resume: int | None, lead: bool):
        import time
        self.cfg, self.model_cfg, self.lead = cfg, model_cfg, lead
        self.path = Path(out_dir) / self.FILE
        self.data = load_draft_set(cfg.path, rows=cfg.rows, prompt_len=cfg.prompt_len, cont_len=cfg.cont_len)
        kept = []
        if self.path.exists():
            kept = [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]
            kept = [r for r in kept if resume is not None and r["step"] <= resume]
            if lead:
                self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.offset = kept[-1]["seconds"] if kept else 0.0
        self.cpu_offset = kept[-1].get("cpu_seconds", 0.0) if kept else 0.0
        self.t0, self.clock = time.perf_counter(), time.perf_counter
        self.cpu0, self.cpu_clock = time.process_time(), time.process_time  # every thread of this process

    def due(self, step: int, end: int) -> bool:
        return step % self.cfg.every == 0 or step == end

    def run(self, step: int, params) -> dict:
        jax.block_until_ready(params)  # the step that made them is training time
        t, c = self.clock(), self.cpu_clock()
        q = draft_quality(params, self.model_cfg, self.data, self.cfg.block_size)
        rec = {"step": step, "seconds": round(self.offset + t - self.t0, 3),  # ms: two short steps stay ordered
               "cpu_seconds": round(self.cpu_offset + c - self.cpu0, 3), **q.as_dict()}
        self.t0 += self.clock() - t  # the metric's own time is not training time
        self.cpu0 += self.cpu_clock() - c
        if self.lead:
            with self.path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec
