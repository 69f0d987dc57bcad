"""The decoding modes (`Mode`: first call, loop step, cache finalize, and a mode's own state): sbd.py (Set Block
Decoding), verify/ (lossless SBD: drafts checked against AR's tokens; its state, drafting policy and call costs)
and ar.py (next-token decoding, the baseline). A new mode is its own module plus one line in `mode_of`."""
from __future__ import annotations

from ..spec import DecodeSpec
from .ar import AR
from .base import Mode
from .sbd import SBD
from .verify import VERIFY


def mode_of(spec: DecodeSpec) -> Mode:
    """The mode `spec` decodes with."""
    if spec.mode == "ar":
        return AR
    return VERIFY if spec.verify else SBD


__all__ = ["AR", "SBD", "VERIFY", "Mode", "mode_of"]
