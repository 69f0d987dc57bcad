"""What a train step builds and runs: the `sbd` section and the frozen specs made from it, validated here, that
go from `TrainConfig.step_options` to the train step, `make_example` and `build_sbd_example` (docs/sbd.md, "Training")."""
from __future__ import annotations

import dataclasses

from ..config import ConfigError


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def require_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    require(value in choices, f"{key} must be {'/'.join(choices)}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SBDConfig:
    """The `sbd` config section: how training examples are built. The messages name its keys."""

    k_max: int = 16  # block size drawn uniformly from [2, k_max] at every step (the paper: [2, 16])
    block_size: int | None = None  # fixed block size instead of the random draw
    ntp_only: bool = False  # the NTP baseline: same code path, only the clean half is run
    block_align: str = "document"  # "document" (paper) | "response" (SFT: blocks start at the response)
    # the mask rate eta ~ U[lo, hi] per document (the paper: [0, 1]); [1, 1] masks every counted token: the
    # all-masked blocks that whole-block drafting (lossless / verify mode) queries
    eta: tuple[float, float] = (0.0, 1.0)
    # MATP weight of a masked token at offset j in its block: position_decay ** j (null: 1). Verify mode keeps a
    # draft only when every draft before it in its block stood, so near offsets are worth more
    position_decay: float | None = None
    # times this at offset 0: lossless decoding never uses a block's first draft (that position is the clean
    # stream's own token in the same forward), lossy SBD does
    offset0_weight: float = 1.0
    # a copy token's target mixes the data's token (weight 1 - soft_targets) with the clean stream's next-token
    # distribution at its position (soft_targets): with a copy-only adapter the clean stream is the base model, so
    # the drafts learn the base's whole distribution, not only its greedy token (lora.copy_only; 0 = off)
    soft_targets: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "eta", tuple(self.eta))
        require(len(self.eta) == 2 and 0.0 <= self.eta[0] <= self.eta[1] <= 1.0,
                f"sbd.eta must be [lo, hi] with 0 <= lo <= hi <= 1, got {list(self.eta)}")
        require(self.position_decay is None or 0.0 < self.position_decay <= 1.0,
                f"sbd.position_decay must be in (0, 1] (or null), got {self.position_decay}")
        require(self.offset0_weight >= 0.0, f"sbd.offset0_weight must be >= 0, got {self.offset0_weight}")
        require(0.0 <= self.soft_targets <= 1.0, f"sbd.soft_targets must be in [0, 1], got {self.soft_targets}")
        require(self.k_max >= 2, f"sbd.k_max must be >= 2 (blocks of 2..k_max), got {self.k_max}")
        require(self.block_size is None or self.block_size >= 1, f"sbd.block_size must be >= 1, got {self.block_size}")
        require_choice("sbd.block_align", self.block_align, ("document", "response"))


@dataclasses.dataclass(frozen=True)
class ExampleSpec(SBDConfig):
    """What `make_example` takes: the `sbd` section (keyword-only fields) plus the mask id and data.copy_len."""

    mask_token_id: int | None = None  # the `<m>` id (SBD examples need it, the NTP baseline does not)
    copy_len: int | None = None  # C: a compact copy stream of C slots holding no prompt (None: the full L)

    def __post_init__(self):
        super().__post_init__()
        require(self.copy_len is None or self.ntp_only or self.block_align == "response",
                "data.copy_len (a copy stream without the prompts) needs sbd.block_align='response': with "
                "document-aligned blocks the prompts are part of the copy stream")


@dataclasses.dataclass(frozen=True)
class StepOptions(ExampleSpec):
    """The example spec plus how the step runs it."""

    grad_accum: int = 1  # microbatches per step
    loss_chunk: int | None = None  # >0: lm_head + cross-entropy over time chunks of this many tokens (None: auto)
