"""Bad decoding input is a `DecodeError` (a ValueError) that names the problem, raised where the input enters:
every check of the decoding API in one table - `generate`, `DecodeSpec`, verify mode's memory and costs, the
continuous engine, `Sampler`. (decode.py's `error:` lines and its resume record: tests/test_reliability.py; bad
checkpoints and configs: tests/test_errors_and_api.py.)"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decoding_fixtures import CFG, LENGTHS, make_prompts

from sbd_jax.decoding import DecodeError, DecodeSpec, DraftMemory, PromptTooLongError, generate
from sbd_jax.decoding.continuous import ContinuousDecoder, decode_stream
from bench.calibrate import calibrate
from sbd_jax.decoding.prompts import Prompt
from sbd_jax.decoding.runner import DecodeOptions, slots_for

OK = {"max_new_tokens": 4, "block_size": 4}


def gen(ids=None, lengths=LENGTHS, cfg=CFG, **kw):
    """`generate` on no weights: every check runs before a weight is read."""
    return generate({}, cfg, make_prompts() if ids is None else ids, lengths, **{**OK, **kw})


def bad_ids():
    ids = make_prompts()
    ids[1, 2] = 64
    return ids


def sampler():
    from sbd_jax.decoding.sampler import Sampler
    from sbd_jax.io.tokenizer import Tokenizer
    return Sampler({}, CFG, Tokenizer.from_callable(lambda s: [5] * len(s.split())))


def test_sampler_options_take_the_dataclasses_defaults():
    """Sampler.options is DecodeOptions / DecodeSpec by field name, every default theirs (continuous slots included),
    the model's stop ids filled in."""
    from sbd_jax.decoding.runner import DecodeOptions
    s = sampler()
    assert s.options(block_size=4, seed=3) == DecodeOptions(spec=DecodeSpec(block_size=4, eos_ids=s.eos_ids), seed=3)
    assert s.options().continuous


K16 = np.full(15, 1e4, np.float32)
MEMORY16 = DraftMemory(hits=K16, trials=K16, stops=0.0, tokens=1e6, since_wide=0)  # a block-size-16 run's

CASES = {
    # generate's request
    "gamma_negative": (lambda: gen(gamma=-0.1), r"gamma must be >= 0 \(and finite\)"),
    "gamma_per_row_shape": (lambda: gen(gamma=[1.0, 2.0]), "gamma must be a scalar or one value per row"),
    "no_mask_token": (lambda: gen(cfg=dataclasses.replace(CFG, mask_token_id=None)), "no mask_token_id"),
    "prompt_too_long": (lambda: gen(np.zeros((1, 125), np.int32), [125]), "max_position_embeddings 128"),
    "lengths_out_of_range": (lambda: gen(lengths=[8, 9, 1, 1]), r"prompt_lengths must be in \[1, 8\]"),
    "ids_beyond_vocab": (lambda: gen(bad_ids()), r"prompt token ids must be in \[0, 64\)"),
    "block_beyond_positions": (lambda: gen(block_size=1_000_000), r"block_size 1000000 \(decode.py --block-size\) "
                                                                  r"is more positions than the model has "
                                                                  r"\(max_position_embeddings 128\)"),
    "mask_token_in_prompt": (lambda: gen(np.array([[5, 63, 7]]), [3]),
                             r"prompt_ids holds the SBD mask token \(id 63\) at row 0, position 1: it marks"),
    "ids_float": (lambda: gen(np.array([[1.7, 2.2]]), np.array([2])), r"prompt_ids must be integers, got dtype float"),
    "lengths_float": (lambda: gen(np.array([[1, 2]]), np.array([1.5])),
                      r"prompt_lengths must be integers, got dtype float64"),
    "row_caps": (lambda: gen(row_max_new_tokens=[1, 2, 3, 5]), r"row_max_new_tokens must be .* each in \[1, "
                                                                 r"max_new_tokens=4\]"),
    "unknown_option": (lambda: gen(blocksize=2), r"unknown decoding option\(s\) \['blocksize'\]"),
    # DecodeSpec, validated where built
    "block_size": (lambda: DecodeSpec(block_size=0), "block_size must be >= 1"),
    "rule": (lambda: DecodeSpec(rule="greedy"), "rule must be one of"),
    "mode": (lambda: DecodeSpec(mode="nar"), "mode must be one of"),
    "top_p": (lambda: DecodeSpec(top_p=0.0), "top_p must be in"),
    "eos_ids": (lambda: DecodeSpec(eos_ids=("eos",)), "eos_ids must be token ids"),
    "verify_of_ar": (lambda: DecodeSpec(mode="ar", verify=True), "verify=True is a mode of SBD decoding"),
    "draft_policy": (lambda: DecodeSpec(verify=True, draft_policy="sometimes"), "draft_policy must be one of"),
    "wide_cost_negative": (lambda: DecodeSpec(verify=True, wide_cost=-1.0), "wide_cost must be a positive number"),
    "wide_cost_count": (lambda: DecodeSpec(verify=True, wide_cost=(2.0, 3.0)), "one per draft width"),
    "wide_cost_text": (lambda: DecodeSpec(verify=True, wide_cost="4"), "one per draft width"),
    # verify mode's memory and costs
    "memory_not_typed": (lambda: gen(verify=True, draft_memory=np.zeros(5)), "draft_memory must be a DraftMemory"),
    "memory_other_block": (lambda: gen(verify=True, draft_memory=MEMORY16), "of a run with block_size 4"),
    "memory_nan": (lambda: gen(verify=True, draft_memory={**DraftMemory.empty(3).as_dict(), "hits": [0.0, np.nan, 0.0]}),
                   r"draft_memory holds values no run produces \(hits=\[0.0, nan, 0.0\]"),
    "memory_hits_above_trials": (lambda: gen(verify=True, draft_memory={**DraftMemory.empty(3).as_dict(),
                                                                        "hits": [2.0, 0.0, 0.0]}),
                                 "hits above trials"),
    "memory_to_ar": (lambda: gen(mode="ar", draft_memory=MEMORY16), "give it to a verify=True run"),
    "calibrate_traced": (lambda: jax.jit(lambda w: jnp.asarray(calibrate({"w": w}, CFG, DecodeSpec(verify=True), 2,
                                                                          64)))(jnp.zeros(2)), "outside jax.jit"),
    # the continuous engine
    "admit_rows": (lambda: ContinuousDecoder({}, CFG, DecodeSpec(**OK), slots=2, prompt_width=4, admit_rows=0),
                   "admit_rows must be >= 1, got 0"),
    "engine_cache": (lambda: ContinuousDecoder({}, CFG, DecodeSpec(**OK, return_cache=True), slots=2, prompt_width=4),
                     "returns no cache"),
    # slots: far beyond memory refused before anything is allocated
    "slots_beyond_memory": (lambda: slots_for(dataclasses.replace(CFG, num_hidden_layers=32, num_key_value_heads=4,
                                                                  head_dim=128),  # 3 MiB of cache per slot
                                              DecodeOptions(spec=DecodeSpec(**OK), batch_size=10**9),
                                              [Prompt(i, i, (1, 2)) for i in range(10**5)]),
                            r"100000 slots \(batch_size, decode.py --batch-size\) need a KV cache of .* GiB per "
                            r"device .* GiB is free: lower the batch size"),
    # the text API
    "sampler_bare_string": (lambda: sampler()("hello"),
                            r"inputs must be a list of prompts .*got str 'hello': for one prompt pass \[prompt\]"),
    "sampler_empty_list": (lambda: sampler()([]), r"inputs is empty: pass at least one prompt"),
    "sampler_eos_beyond_vocab": (lambda: sampler()(["a b"], eos_ids=(70,)),
                                 r"eos id\(s\) \[70\] .* outside the vocabulary \[0, 64\)"),
    "sampler_unknown_option": (lambda: sampler()(["a b"], blocksize=2),
                               r"unknown decoding option\(s\) \['blocksize'\]; valid: \[.*'gamma'.*DecodeSpec's"),
    "sampler_bad_message": (lambda: sampler()([{"role": "user"}]), "input 0: expected a string"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_named(case):
    call, match = CASES[case]
    with pytest.raises(DecodeError, match=match):
        call()


def test_slots_are_capped_by_the_prompts():
    """More slots than prompts would decode copies: a million asked for 3 prompts makes 3 (no allocation for more)."""
    opts = DecodeOptions(spec=DecodeSpec(**OK), batch_size=10**6)
    assert slots_for(CFG, opts, [Prompt(i, i, (1, 2)) for i in range(3)]).batch_size == 3
    assert slots_for(CFG, dataclasses.replace(opts, batch_size=2), [Prompt(i, i, (1,)) for i in range(3)]) \
        .batch_size == 2


def test_error_types():
    assert issubclass(DecodeError, ValueError) and issubclass(PromptTooLongError, DecodeError)
    with pytest.raises(PromptTooLongError):
        CASES["prompt_too_long"][0]()


def test_a_stream_prompt_wider_than_the_engine_is_named(params):
    """The continuous engine checks each prompt of its stream as it is admitted (its first program compiled)."""
    with pytest.raises(DecodeError, match=r"prompt 0 has 5 tokens; this decoder takes 1 to 4"):
        list(decode_stream(params, CFG, [[1, 2, 3, 4, 5]], DecodeSpec(**OK), slots=2, prompt_width=4))


@pytest.mark.parametrize("weights", ["nan", "overflow"])
def test_nonfinite_logits_are_named_never_tokens(params, weights):
    """NaN weights, or finite ones whose forward overflows (a 1e38 final norm: inf/NaN logits): every mode's
    `generate` marks those positions -1 (sampling.NONFINITE) instead of choosing from garbage (greedy once chose 0
    everywhere), and a host-side row (the continuous engine, the batch runner, Sampler) is a DecodeError naming it."""
    bad = {**params, "final_norm": params["final_norm"] * (np.nan if weights == "nan" else 1e38)}
    for kw in (dict(mode="ar"), dict(mode="sbd"), dict(mode="sbd", verify=True, draft_policy="always")):
        out = generate(bad, CFG, make_prompts(), LENGTHS, max_new_tokens=4, block_size=2, **kw)
        toks, n = np.asarray(out.tokens), np.asarray(out.lengths)
        assert all((toks[b, :n[b]] < 0).any() for b in range(len(n))), (kw, toks)
    with pytest.raises(DecodeError, match=r"the model's logits are not finite \(NaN or inf\) at generated token 0 "):
        list(decode_stream(bad, CFG, [[1, 2, 3]], DecodeSpec(**OK), slots=2, prompt_width=4))
