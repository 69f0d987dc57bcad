"""SBD decoding, in layers (each imports only the ones above it, by public names):

  spec.py      DecodeSpec (what shapes the compiled decoder) and the defaults every entry point uses
  checks.py    the request checks (model, prompt fits, caps, vocabulary, rates)
  sampling.py  entropies, the acceptance rules, token sampling
  state.py     the loop state (`LoopState`, per-row fields marked `Row`, a mode's own in `mode_state`) and
               environment (`DecodeEnv`)
  prefill.py   writing prompts into the cache
  modes/       sbd.py, ar.py, verify/: each mode's first call, loop step, cache finalize and own state
               (verify/: its counts, `DraftMemory`, drafting policy and call costs)
  loop.py      the one `lax.while_loop` driver
  decoder.py   `generate` -> `GenerateOutput` (`GenerateCall`: the same call, ahead of time)
  continuous.py  the continuous batching engine (init / admit / step / harvest) and its `ProgramCache`
  results.py   `RowResult` (one finished row, every row-at-a-time entry point) and `RunSummary` (a batch run)
  runner.py, sampler.py, prompts.py, roofline.py: the batch runner, text in / text out, files, bandwidth
"""
from .checks import check_request
from .decoder import GenerateCall, GenerateOutput, generate
from .modes.verify import DraftMemory, VerifyStats
from .results import RowResult, RunSummary
from .sampling import accept, accept_eb, accept_threshold, entropy, sample, shape_logits
from .spec import DEFAULT_BLOCK_SIZE, DEFAULT_GAMMA, MODES, RULES, DecodeError, DecodeSpec, PromptTooLongError

__all__ = ["DEFAULT_BLOCK_SIZE", "DraftMemory", "VerifyStats", "DEFAULT_GAMMA", "MODES", "RULES", "DecodeError", "DecodeSpec",
           "GenerateCall", "GenerateOutput", "RunSummary",
           "PromptTooLongError", "RowResult", "accept", "accept_eb", "accept_threshold", "check_request", "entropy",
           "generate", "sample", "shape_logits"]
