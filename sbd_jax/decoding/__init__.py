"""SBD decoding, in layers (each imports only the ones above it, by public names):

  spec.py      DecodeSpec (what shapes the compiled decoder) and the defaults every entry point uses
  checks.py    the request checks (model, prompt fits, caps, vocabulary, rates)
  sampling.py  entropies, the acceptance rules, token sampling
  state.py     the loop state (`LoopState`, per-row fields marked `Row`) and environment (`DecodeEnv`)
  prefill.py   writing prompts into the cache
  costs.py     what a 2k-wide call costs next to a 1-wide one on this device (measured once per shape)
  policy.py    verify mode's drafting policy: per call a 2k-wide check-and-draft or a 1-wide AR call
  modes/       sbd.py, verify.py, ar.py: each mode's first call, loop step and cache finalize
  loop.py      the one `lax.while_loop` driver
  decoder.py   `generate` / `prepare_generate` / `generate_jit` -> `GenerateOutput`
  continuous.py  the continuous batching engine (init / admit / step / harvest) and its `ProgramCache`
  results.py   `RowResult`, one finished row (every row-at-a-time entry point)
  runner.py, sampler.py, prompts.py, roofline.py: the batch runner, text in / text out, files, bandwidth
"""
from . import costs, policy
from .checks import check_request
from .decoder import GenerateOutput, generate, generate_jit, prepare_generate
from .results import RowResult
from .sampling import accept, accept_eb, accept_threshold, entropy, sample, shape_logits
from .spec import DEFAULT_BLOCK_SIZE, DEFAULT_GAMMA, MODES, RULES, DecodeError, DecodeSpec, PromptTooLongError

__all__ = ["costs", "policy", "DEFAULT_BLOCK_SIZE", "DEFAULT_GAMMA", "MODES", "RULES", "DecodeError", "DecodeSpec",
           "GenerateOutput",
           "PromptTooLongError", "RowResult", "accept", "accept_eb", "accept_threshold", "check_request", "entropy",
           "generate", "generate_jit", "prepare_generate", "sample", "shape_logits"]
