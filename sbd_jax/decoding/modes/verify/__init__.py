"""Verify mode, lossless SBD (docs/sbd.md, "Lossless mode"), all in this package: its loop steps (step.py), its state
and what it reports (state.py), its drafting policy (policy.py) and the call costs the policy weighs (costs.py).
SBD and AR runs carry none of it."""
from __future__ import annotations

from ..base import Mode
from . import costs, policy
from .state import DraftMemory, VerifyState, VerifyStats
from .step import admit, finalize, first, init_state, report, start_from, step

VERIFY = Mode("verify", init_state=init_state, first=first, step=step, finalize=finalize, admit=admit,
              prefills_last_token=False, report=report, memory=policy.memory, retire=policy.retire,
              start_from=start_from)

__all__ = ["VERIFY", "DraftMemory", "VerifyState", "VerifyStats", "costs", "policy"]
