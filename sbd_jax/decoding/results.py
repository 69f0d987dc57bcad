"""What decoding returns. Three shapes, by what the caller holds:

  * `GenerateOutput` (decoder.py): a batch's arrays, from `generate` (device arrays, jittable).
  * `RowResult`: one finished row on the host, from every row-at-a-time entry point: `decode_stream` and the
    continuous engine, the batch runner's `on_row` (decode.py writes `to_json()` as a JSON line, with "id"),
    `Sampler.decode`'s `on_row` and `Sampler.__call__` (with its text and prompt length).
  * `RunSummary`: a batch run's totals (runner.py), with AR's when the run compared against it.
A row is frozen: a caller adds its own fields with `dataclasses.replace`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .spec import DecodeError


@dataclasses.dataclass(frozen=True)
class RowResult:
    """One finished row."""

    tokens: list[int]  # generated ids, the stop token included when the row stopped on one
    nfe: int  # model calls that carried a token of the row
    stop: str  # "eos" (a stop id) or "length" (its max_new_tokens)
    accepted: list[int]  # how many of the row's calls decoded 0, 1, ... tokens
    stats: dict = dataclasses.field(default_factory=dict)  # its mode's per-row report (verify: drafts, agreed)
    text: str | None = None  # the tokens as text (Sampler / decode.py, when the model has a tokenizer)
    prompt_tokens: int | None = None  # the prompt's length in tokens (Sampler / decode.py)
    ar: RowResult | None = None  # compare_ar: the same prompt decoded by AR

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_forward(self) -> float:
        return self.n_tokens / max(self.nfe, 1)

    def to_json(self) -> dict:
        """The row as decode.py writes it (the per-call histogram is in the run's summary, not in each row)."""
        out = {"tokens": self.tokens, "n_tokens": self.n_tokens, "nfe": self.nfe,
               "tokens_per_forward": self.tokens_per_forward, "stop": self.stop, **self.stats}
        out.update({f: getattr(self, f) for f in ("text", "prompt_tokens") if getattr(self, f) is not None})
        if self.ar is not None:
            out["ar"] = self.ar.to_json()
        return out


def row_stats(stats, b: int) -> dict:
    """Row `b`'s entries of a mode's report (`GenerateOutput.mode_stats` on the host: its [B] fields, e.g. verify
    mode's drafts and agreed; {} for a mode with none)."""
    if stats is None:
        return {}
    return {f: int(v[b]) for f, v in stats._asdict().items() if getattr(v, "ndim", 0) == 1}


def row_result(tokens, nfe: int, eos: bool, accepted, stats: dict | None = None) -> RowResult:
    """One finished row; a row with a NONFINITE token (sampling.py: the model's logits were not finite there) is a
    DecodeError naming where, never tokens chosen from garbage."""
    bad = np.flatnonzero(np.asarray(tokens) < 0)
    if bad.size:
        raise DecodeError(f"the model's logits are not finite (NaN or inf) at generated token {int(bad[0])} of a row "
                          f"({len(tokens)} tokens): its weights (or quantization scales) are NaN or overflow in "
                          "the forward; no tokens are returned")
    return RowResult(tokens=[int(t) for t in tokens], nfe=int(nfe), stop="eos" if eos else "length",
                     accepted=[int(a) for a in accepted], stats=stats or {})


@dataclasses.dataclass
class Totals:
    """Sums over a run's rows (built as rows finish)."""

    rows: int = 0
    tokens: int = 0
    nfe: int = 0
    model_calls: int = 0  # batched model calls of the decode loops (prefill pieces apart)
    seconds: float = 0.0  # decoding time (compilation and the caller's row handling apart)
    accepted: np.ndarray | None = None  # calls that decoded 0, 1, ... tokens, over every row
    stats: dict = dataclasses.field(default_factory=dict)  # sums of the rows' mode stats

    def add(self, row: RowResult) -> None:
        self.rows += 1
        self.tokens += row.n_tokens
        self.nfe += row.nfe
        hist = np.asarray(row.accepted, np.int64)
        self.accepted = hist if self.accepted is None else self.accepted + hist
        for f, v in row.stats.items():
            self.stats[f] = self.stats.get(f, 0) + v

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.nfe if self.nfe else float("nan")

    def to_json(self) -> dict:
        return {"rows": self.rows, "tokens": self.tokens, "nfe": self.nfe, "model_calls": self.model_calls,
                "seconds": round(self.seconds, 4), "tokens_per_s": self.tokens_per_s,
                "tokens_per_forward": self.tokens_per_forward,
                "accepted_per_forward": [] if self.accepted is None else self.accepted.tolist(), **self.stats}


@dataclasses.dataclass
class RunSummary(Totals):
    """A batch run (`decode_prompts`, `BatchDecoder.decode`): its totals and what it ran; with compare_ar, AR's
    totals on the same prompts and the ids of the rows whose tokens differ from AR's."""

    mode: str = "sbd"
    verify: bool = False
    continuous: bool = False
    block_size: int = 0
    compile_seconds: float = 0.0
    draft_memory: object = None  # verify mode: what the drafting policy learned (a DraftMemory), for a later run
    ar: Totals | None = None
    differing: list = dataclasses.field(default_factory=list)

    @property
    def drafts(self) -> int:
        return self.stats.get("drafts", 0)

    @property
    def drafts_agreed(self) -> int:
        return self.stats.get("agreed", 0)

    @property
    def speedup_tokens_per_s(self) -> float | None:
        return None if self.ar is None else self.tokens_per_s / self.ar.tokens_per_s

    @property
    def same_tokens_as_ar(self) -> float | None:
        return None if self.ar is None else 1 - len(self.differing) / max(self.rows, 1)

    def to_json(self) -> dict:
        t = super().to_json()
        for f in self.stats:
            del t[f]
        out = {"mode": self.mode, "verify": self.verify, "continuous": self.continuous, **t,
               "compile_seconds": round(self.compile_seconds, 3)}
        if self.verify:
            out.update(drafts=self.drafts, drafts_agreed=self.drafts_agreed,
                       draft_acceptance=self.drafts_agreed / self.drafts if self.drafts else 0.0,
                       tokens_per_forward_ceiling=float(self.block_size))
        if self.draft_memory is not None:
            out["draft_memory"] = self.draft_memory.as_dict()
        if self.ar is not None:
            out.update(ar=self.ar.to_json(), speedup_tokens_per_s=self.speedup_tokens_per_s,
                       same_tokens_as_ar=self.same_tokens_as_ar, rows_differing_from_ar=self.differing[:20],
                       n_rows_differing_from_ar=len(self.differing))
        return out
