"""The decoding modes, one module each (first call, loop step, cache finalize): sbd.py (Set Block Decoding),
verify.py (lossless SBD: drafts checked against AR's tokens) and ar.py (next-token decoding, the baseline)."""
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
