"""SBD decoding: `generate` (a jitted lax.while_loop decoder over a static KV cache, SBD or AR) configured
by a `DecodeSpec`, the sampling / acceptance rules, and the batch runner behind decode.py."""
from .checks import check_request
from .decoder import GenerateOutput, generate, generate_jit, prepare_generate
from .sampling import accept, accept_eb, accept_threshold, entropy, sample, shape_logits
from .spec import DEFAULT_BLOCK_SIZE, DEFAULT_GAMMA, MODES, RULES, DecodeError, DecodeSpec, PromptTooLongError

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_GAMMA",
           "MODES", "RULES", "DecodeError", "DecodeSpec", "GenerateOutput", "PromptTooLongError", "accept",
           "accept_eb", "accept_threshold", "check_request", "entropy", "generate", "generate_jit",
           "prepare_generate", "sample", "shape_logits"]
