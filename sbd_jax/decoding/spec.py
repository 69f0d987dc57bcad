"""Decoding options: `DecodeSpec`, one frozen, hashable record of everything that shapes the compiled
decoder (a static argument of the jitted loop), validated once where it is built. The values that may
change per call without recompiling (gamma, temperature, keys, prompts) are arguments of `generate`."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

MODES = ("sbd", "ar")
RULES = ("eb", "threshold")
# verify mode's choice per call between a 1-wide AR call and a wide call that checks and drafts (policy.py)
DRAFT_POLICIES = ("adaptive", "always", "never")
KV_CACHE_DTYPES = ("int8",)  # the KV cache's storage besides the model's compute dtype (None, the default)
# the defaults of every entry point (generate, DecodeSpec, DecodeOptions, Sampler, decode.py, the demo)
DEFAULT_GAMMA = 0.35  # acceptance threshold of the rule (the EB rule's middle setting)
DEFAULT_BLOCK_SIZE = 16  # SBD block size k
DEFAULT_TEMPERATURE = 0.0  # greedy
DEFAULT_MAX_NEW_TOKENS = 256


class DecodeError(ValueError):
    """A decoding request that cannot be served as asked (bad option, prompt too long, ...)."""


class PromptTooLongError(DecodeError):
    """Prompt + max_new_tokens do not fit the cache / the model's positions."""


def _is_positive(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and x > 0


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """What shapes the compiled decoder (one compilation per spec and prompt shape)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # cap on generated tokens per row
    mode: str = "sbd"  # "sbd" (Set Block Decoding) | "ar" (next-token decoding, the baseline)
    block_size: int = DEFAULT_BLOCK_SIZE  # SBD: positions per block (AR makes one token per step)
    rule: str = "eb"  # SBD acceptance rule: "eb" (the paper's entropy bound) | "threshold" (sampling.py)
    # SBD lossless mode (docs/sbd.md, "Lossless mode"): every block is checked against AR's tokens by the next call's
    # clean queries; the output equals AR mode's for the same key, drafts only decide how many calls it takes
    verify: bool = False
    # verify mode: "adaptive" drafts where the rows' recent acceptance pays for the wider call on this device
    # (policy.py); "always" / "never" force the widest / the 1-wide AR call; or a function choose(state, env) ->
    # the call's kind (a traced int: 0 = a 1-wide AR call, i >= 1 = draft width `draft_widths[i - 1]`).
    # Never changes a row's tokens, only its calls.
    draft_policy: str | Callable = "adaptive"
    # verify mode: what the widest call (k clean + k * k copy queries) costs in 1-wide calls at this batch
    # (narrower ones in proportion to their queries), or one cost per draft width (bench/calibrate.py's result); None:
    # the cost model's estimate (modes/verify/costs.py). The adaptive policy drafts while the expected tokens per
    # unit of cost beat AR's.
    wide_cost: float | tuple[float, ...] | None = None
    top_k: int = 0  # 0 = off; top_k and top_p shape the sampling distribution, not the entropies
    top_p: float = 1.0  # 1 = off
    tempered_entropy: bool = False  # entropies on the tempered distribution for rows with temperature > 0
    eos_ids: tuple[int, ...] | None = None  # stop tokens (None: the model's eos_token_id; (): never stop early)
    pad_id: int | None = None  # fills the output beyond each row's length (None: the model's pad id, else 0)
    # the KV cache's storage: None = the compute dtype; "int8" = int8 values with a scale per position and KV head
    # (half of bf16's bytes: longer generations at a larger batch; tokens near the full cache's, and verify mode
    # still exactly AR's on the same int8 cache)
    kv_cache_dtype: str | None = None
    # prompts wider than this are prefilled in pieces of this many columns (one call each, the last one with the
    # first decoding step), so prefill memory scales with the piece, not the prompt
    prefill_chunk: int = 256
    # SBD: a call runs the 2k window [finished blocks CLEAN ; current blocks COPY] once at least this share of the
    # running rows has a finished block to commit; until then those rows sit out k-wide calls (their tokens and
    # NFE unchanged: only the batch's call count and the calls' widths change). 0 = whenever any row has one (for
    # hardware where 2k tokens per row cost what k cost, e.g. small batches on a GPU); 1 = only when all have
    commit_quorum: float = 0.5
    # one extra uncounted call writes the K/V the loop left uncommitted: the cache then equals one causal
    # forward over prompt + output
    finalize_cache: bool = False
    return_cache: bool = False

    # fields that change how fast rows decode, never a row
    SPEED_ONLY = ("prefill_chunk", "commit_quorum", "draft_policy", "wide_cost")

    def __post_init__(self):
        if self.mode not in MODES:
            raise DecodeError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.rule not in RULES:
            raise DecodeError(f"rule must be one of {RULES}, got {self.rule!r}")
        if not (callable(self.draft_policy) or self.draft_policy in DRAFT_POLICIES):
            raise DecodeError(f"draft_policy must be one of {DRAFT_POLICIES} or a function choose(state, env), got "
                              f"{self.draft_policy!r}")
        try:  # a static argument of the compiled decoder: a program per distinct (hashable) policy
            hash(self.draft_policy)
        except TypeError:
            raise DecodeError(f"draft_policy {self.draft_policy!r} is not hashable: pass a function") from None
        wc = self.wide_cost
        if isinstance(wc, (list, tuple)):
            object.__setattr__(self, "wide_cost", wc := tuple(wc))
        n = len(self.draft_widths)
        if wc is not None and not (_is_positive(wc) or (isinstance(wc, tuple) and len(wc) == n
                                                           and all(map(_is_positive, wc)))):
            raise DecodeError(f"wide_cost must be a positive number (the widest call's cost in 1-wide calls), {n} of "
                              f"them (one per draft width {self.draft_widths}, as bench/calibrate.py measures) or None (the "
                              f"cost model), got {self.wide_cost!r}")
        if self.verify and self.mode != "sbd":
            raise DecodeError("verify=True is a mode of SBD decoding (mode='sbd'); AR mode is what it reproduces")
        for name, low in (("max_new_tokens", 1), ("block_size", 1), ("top_k", 0), ("prefill_chunk", 1)):
            v = getattr(self, name)
            if not _is_int(v) or v < low:
                raise DecodeError(f"{name} must be >= {low} (an integer), got {v!r}")
        if not 0.0 <= float(self.commit_quorum) <= 1.0:
            raise DecodeError(f"commit_quorum must be in [0, 1] (a share of the running rows), got {self.commit_quorum!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise DecodeError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        eos = self.eos_ids
        if eos is not None:
            eos = (eos,) if _is_int(eos) else tuple(eos)
            if not all(_is_int(e) for e in eos):
                raise DecodeError(f"eos_ids must be token ids (integers), got {self.eos_ids!r}")
            object.__setattr__(self, "eos_ids", tuple(int(e) for e in eos))
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise DecodeError(f"kv_cache_dtype must be None (the compute dtype) or one of {KV_CACHE_DTYPES}, got "
                              f"{self.kv_cache_dtype!r}")
        if self.pad_id is not None and not _is_int(self.pad_id):
            raise DecodeError(f"pad_id must be a token id (an integer), got {self.pad_id!r}")

    @classmethod
    def make(cls, spec: DecodeSpec | None = None, **options) -> DecodeSpec:
        """`spec` with `options` replaced (or a new spec from `options`); an unknown option is a DecodeError."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise DecodeError(f"unknown decoding option(s) {unknown}; valid: {[f.name for f in dataclasses.fields(cls)]}")
        return dataclasses.replace(spec, **options) if spec is not None else cls(**options)

    @property
    def window(self) -> int:
        """Tokens decoded per block: block_size for SBD, 1 for AR."""
        return self.block_size if self.mode == "sbd" else 1

    @property
    def draft_widths(self) -> tuple[int, ...]:
        """Verify mode: the draft widths (block sizes) its calls may use, widest first: k, k/2, k/4, k/8 (at least
        2). Width 2 (6 queries per row) is the one a compute-bound device at batch 1 can afford."""
        k = self.block_size
        return tuple(sorted({k} | {w for w in (k // 2, k // 4, k // 8) if w >= 2}, reverse=True))

    def stated_call_costs(self) -> tuple[float, ...]:
        """Per draft width, a width-w call's cost in 1-wide calls from `wide_cost`: as given per width, or from the
        widest call's (narrower ones in proportion to their queries, w + w * w)."""
        if isinstance(self.wide_cost, tuple):
            return tuple(float(c) for c in self.wide_cost)
        c, k = float(self.wide_cost), self.block_size
        return tuple(1.0 + (c - 1.0) * (w + w * w) / (k + k * k) for w in self.draft_widths)

    def stop_ids(self, cfg) -> tuple[int, ...]:
        return cfg.eos_ids if self.eos_ids is None else self.eos_ids

    def pad(self, cfg) -> int:
        return self.pad_id if self.pad_id is not None else (cfg.pad_token_id or 0)
