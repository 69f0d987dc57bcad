"""What a train step builds and runs: one frozen spec, validated here when it is built, that goes from
`TrainConfig.step_options` to the train step, `make_example` and `build_sbd_example` (SBD.md, training)."""
from __future__ import annotations

import dataclasses

from ..config import ConfigError


@dataclasses.dataclass(frozen=True)
class ExampleSpec:
    """How a step's examples are built. The messages name the config keys the fields come from."""

    mask_token_id: int | None = None  # the `<m>` id (SBD examples need it, the NTP baseline does not)
    k_max: int = 16  # block size drawn uniformly from [2, k_max] at every step
    block_size: int | None = None  # a fixed block size instead of the draw
    ntp_only: bool = False  # the NTP baseline: only the clean half
    block_align: str = "document"  # blocks start at the document ("document") or at the response ("response")
    copy_len: int | None = None  # C: a compact copy stream of C slots holding no prompt (None: the full L)

    def __post_init__(self):
        if self.k_max < 2:
            raise ConfigError(f"sbd.k_max must be >= 2 (blocks of 2..k_max), got {self.k_max}")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"sbd.block_size must be >= 1, got {self.block_size}")
        if self.block_align not in ("document", "response"):
            raise ConfigError(f"sbd.block_align must be 'document' or 'response', got {self.block_align!r}")
        if self.copy_len is not None and not self.ntp_only and self.block_align != "response":
            raise ConfigError("data.copy_len (a copy stream without the prompts) needs sbd.block_align="
                              "'response': with document-aligned blocks the prompts are part of the copy stream")

    @property
    def largest_block(self) -> int:
        return self.block_size if self.block_size is not None else self.k_max


@dataclasses.dataclass(frozen=True)
class StepOptions(ExampleSpec):
    """The example spec plus how the step runs it."""

    grad_accum: int = 1  # microbatches per step
    loss_chunk: int = 0  # >0: lm_head + cross-entropy over time chunks of this many tokens
