"""What decoding returns. Two shapes, by what the caller holds:

  * `GenerateOutput` (decoder.py): a batch's arrays, from `generate` / `generate_jit` (device arrays, jittable).
  * `RowResult`: one finished row on the host, from every row-at-a-time entry point: `decode_stream` and
    `ContinuousDecoder.decode` / `harvest`, the batch runner's `on_row` (decode.py writes it as a JSON line, with
    "id" and "prompt_tokens"), `Sampler.decode`'s `on_row` and `Sampler.__call__` (with "text" and
    "prompt_tokens"). A plain dict with these keys, so it is written to JSON as is.
"""
from __future__ import annotations

from typing import NotRequired, TypedDict


class RowResult(TypedDict):
    """One finished row."""

    tokens: list[int]  # generated ids, the stop token included when the row stopped on one
    n_tokens: int
    nfe: int  # model calls that carried a token of the row
    tokens_per_forward: float
    stop: str  # "eos" (a stop id) or "length" (its max_new_tokens)
    # per model call of the row: how many calls decoded 0, 1, ... tokens (continuous engine; in the batch runner's
    # summary instead of each row)
    accepted: NotRequired[list[int]]
    drafts: NotRequired[int]  # verify mode: drafts placed
    agreed: NotRequired[int]  # verify mode: drafts that stood (agreed with AR's token)
    text: NotRequired[str]  # Sampler / decode.py: the tokens as text, when the model has a tokenizer
    prompt_tokens: NotRequired[int]  # Sampler / decode.py: the prompt's length in tokens
    ar: NotRequired[RowResult]  # compare_ar: the same prompt decoded by AR


def row_stats(stats, b: int) -> dict:
    """Row `b`'s entries of a mode's report (`GenerateOutput.mode_stats` on the host: its [B] fields, e.g. verify
    mode's drafts and agreed; {} for a mode with none)."""
    if stats is None:
        return {}
    return {f: int(v[b]) for f, v in stats._asdict().items() if getattr(v, "ndim", 0) == 1}


def row_result(tokens: list[int], nfe: int, eos: bool, accepted: list[int] | None = None,
               stats: dict | None = None) -> RowResult:
    """`stats`: the row's entries of its mode's report (`row_stats`)."""
    n = len(tokens)
    row = RowResult(tokens=tokens, n_tokens=n, nfe=nfe, tokens_per_forward=n / max(nfe, 1),
                    stop="eos" if eos else "length")
    if accepted is not None:
        row["accepted"] = accepted
    row.update(stats or {})
    return row
