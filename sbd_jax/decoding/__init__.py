"""SBD decoding: `generate` (jitted lax.while_loop decoder over a static KV cache, SBD or AR), the
sampling / acceptance rules, and `brute_force_generate` (the no-cache reference used by tests)."""
from .decoder import (
    DecodeError,
    GenerateOutput,
    PromptTooLongError,
    check_request,
    generate,
    generate_jit,
    prepare_generate,
)
from .sampling import (
    RULES,
    accept,
    accept_eb,
    accept_threshold,
    entropy,
    sample,
    shape_logits,
)

__all__ = ["RULES", "DecodeError", "GenerateOutput", "PromptTooLongError", "accept", "accept_eb",
           "accept_threshold", "check_request", "entropy", "generate", "generate_jit", "prepare_generate",
           "sample", "shape_logits"]
