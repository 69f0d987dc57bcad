"""The toy demo's settings (`python -m demos.toy` overrides any field), used by pipeline.py (which re-exports
DemoConfig) and stages.py."""
from __future__ import annotations

import dataclasses

from sbd_jax.config import ConfigError
from sbd_jax.decoding.spec import DEFAULT_BLOCK_SIZE, DRAFT_POLICIES


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
    # fine-tunes: an SBD copy stream of the responses only (data.copy_len; responses are ~56% of the tokens);
    # the baseline's rows are packed under the same budget, so both fine-tunes see the same rows
    copy_len: int | None = 80
    batch_size: int = 8  # more, smaller SBD updates for the same CPU time (docs/demo_experiments.md)
    pretrain_steps: int = 1200
    finetune_steps: int = 2800  # the SBD fine-tune's length decides the result (docs/demo_experiments.md)
    pretrain_lr: float = 2e-3
    finetune_lr: float = 2e-3
    k_max: int = 16
    train_block_size: int | None = None  # fixed training block size instead of k ~ U[2, k_max] (the paper's)
    block_align: str = "response"  # SFT blocks start at the response, as at inference after the prompt
    # evaluation
    block_size: int = DEFAULT_BLOCK_SIZE
    gammas: tuple[float, ...] = (0.1, 0.35, 0.6, 1.0)  # EB rule (the paper's): low 0.1, middle 0.35, high 0.6
    threshold_gammas: tuple[float, ...] = (0.1, 0.35, 0.6)  # the threshold rule (docs/sbd.md, Inference step 4), for comparison
    # lossless (verify) rows, one per drafting policy (DecodeSpec.draft_policy; gamma and rule play no part):
    # the default "adaptive", and "always" (every call drafting at the widest width: the drafts' quality, the ceiling of drafting)
    lossless_policies: tuple[str, ...] = ("adaptive", "always")
    wide_cost: float | None = None  # lossless rows: the widest call's cost in AR calls (None: the cost model's)
    max_new_tokens: int = 48
    eval_batch: int = 100
    latency_n: int = 100  # problems also decoded one at a time (batch 1) for the latency-bound tokens/s
    timing_rounds: int = 3  # every decoder timed this many times, interleaved; tokens/s from the median round

    def __post_init__(self):
        if self.timing_rounds < 1:
            raise ConfigError(f"timing_rounds must be >= 1, got {self.timing_rounds}")
        check_policies(self.lossless_policies)

    @classmethod
    def quick(cls, **kw) -> "DemoConfig":
        base = dict(n_pretrain=3000, n_finetune=3000, n_test=64, hidden_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, intermediate_size=192, batch_size=16, pretrain_steps=300,
                    finetune_steps=250, gammas=(0.35, 3.0), threshold_gammas=(0.35,),
                    lossless_policies=("adaptive", "always"), eval_batch=64, latency_n=16, timing_rounds=2,
                    out_dir="results/quick")
        return cls(**{**base, **kw})


def check_policies(policies) -> None:
    """`lossless_policies` (both demos): a tuple of DRAFT_POLICIES names; a ConfigError names a bad value."""
    if isinstance(policies, str) or not isinstance(policies, (tuple, list)):
        raise ConfigError(f"lossless_policies must be a tuple of names of {DRAFT_POLICIES}, got {policies!r}")
    for p in policies:
        if p not in DRAFT_POLICIES:
            raise ConfigError(f"lossless_policies: unknown drafting policy {p!r}; valid: {DRAFT_POLICIES}")
