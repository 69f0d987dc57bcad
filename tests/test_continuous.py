"""Continuous batching (sbd_jax/decoding/continuous.py): each row's tokens, NFE and stop equal the same prompt
decoded alone by `generate`, whatever its slot and neighbours, for SBD and AR, with ragged prompts, per-row
caps, EOS and sampling; a stream longer than the slots runs on the same compiled programs."""
import jax
import numpy as np
import pytest
from test_decoding import CFG

from sbd_jax.decoding import DecodeSpec, generate
from sbd_jax.decoding.continuous import ContinuousDecoder, Request, decode_stream
from sbd_jax.decoding.spec import DecodeError


def _requests(n, seed=0):
    rng = np.random.default_rng(seed)
    base = jax.random.key(7)
    return [Request(tuple(int(t) for t in rng.integers(0, 62, rng.integers(1, 9))), jax.random.fold_in(base, i),
                    int(rng.integers(1, 19))) for i in range(n)]


def _alone(params, spec, r, width=8, **kw):
    """The request decoded alone by `generate`, its prompt right-padded to `width` (one program for every
    request; a row does not depend on its padding, tests/test_decoding.py)."""
    out = generate(params, CFG, np.asarray([list(r.ids) + [0] * (width - len(r.ids))]), [len(r.ids)], spec,
                   key=r.key[None], row_max_new_tokens=[r.max_new_tokens], **kw)
    n = int(out.lengths[0])
    return {"tokens": np.asarray(out.tokens)[0, :n].tolist(), "nfe": int(out.nfe[0]),
            "stop": "eos" if bool(out.stopped_by_eos[0]) else "length", "accepted": np.asarray(out.accepted)[0].tolist()}


@pytest.mark.parametrize("mode", ["sbd", "ar", "verify"])
def test_continuous_rows_equal_each_prompt_alone(params, mode):
    reqs = _requests(13)
    kw = dict(gamma=0.5, temperature=1.0)
    plain = DecodeSpec(mode="sbd" if mode == "verify" else mode, verify=mode == "verify", max_new_tokens=18,
                       block_size=4, eos_ids=())
    alone = [_alone(params, plain, r, **kw) for r in reqs]
    # an EOS id the rows really emit, so that some stop early
    eos = max(set(range(62)), key=lambda t: sum(t in a["tokens"][1:] for a in alone))
    # prefill_chunk 3: admissions write 1-8 token prompts in as many 3-column pieces as the longest needs
    # admit_rows 2: the first three prompts are admitted by two calls (2 + 1 rows)
    for spec, admit in ((plain, 16), (DecodeSpec.make(plain, prefill_chunk=3), 16), (plain, 2),
                        (DecodeSpec.make(plain, eos_ids=(eos,)), 16)):
        want = alone if not spec.eos_ids else [_alone(params, spec, r, **kw) for r in reqs]
        dec = ContinuousDecoder(params, CFG, spec, slots=3, prompt_width=8, admit_rows=admit, **kw)
        got = dict(dec.decode(reqs))
        assert sorted(got) == list(range(len(reqs)))
        for i, w in enumerate(want):
            assert {k: got[i][k] for k in w} == w, (spec.eos_ids, i)
        assert sum(r["n_tokens"] for r in got.values()) == sum(len(w["tokens"]) for w in want)
        # 13 prompts through 3 slots on one loop program and admission programs for 1, 2 or 4 rows (<= admit)
        allowed = {"empty", "run"} | {f"admit{r}" for r in (1, 2, 4) if r <= admit}
        assert "run" in dec._programs and set(dec._programs) <= allowed, (admit, set(dec._programs))
        assert admit > 2 or "admit2" in dec._programs
    assert any(w["stop"] == "eos" for w in want) and any(w["stop"] == "length" for w in want)
    again = ContinuousDecoder(params, CFG, spec, slots=3, prompt_width=8, **kw)  # a later call: no recompilation
    assert dict(again.decode(reqs)) == got and again.compile_s == 0.0


def test_decode_stream_and_errors(params):
    spec = DecodeSpec(max_new_tokens=6, block_size=4, eos_ids=())
    got = dict(decode_stream(params, CFG, [[1, 2, 3], [4], [5, 6]], spec, slots=2, prompt_width=4, gamma=2.0))
    for i, ids in enumerate([[1, 2, 3], [4], [5, 6]]):
        ref = generate(params, CFG, np.asarray([ids + [0] * (4 - len(ids))]), [len(ids)], spec, gamma=2.0)
        assert got[i]["tokens"] == np.asarray(ref.tokens)[0].tolist()
    with pytest.raises(DecodeError, match=r"prompt 0 has 5 tokens; this decoder takes 1 to 4"):
        list(decode_stream(params, CFG, [[1, 2, 3, 4, 5]], spec, slots=2, prompt_width=4))
    with pytest.raises(DecodeError, match="admit_rows must be >= 1, got 0"):
        ContinuousDecoder(params, CFG, spec, slots=2, prompt_width=4, admit_rows=0)
    with pytest.raises(DecodeError, match="returns no cache"):
        ContinuousDecoder(params, CFG, DecodeSpec.make(spec, return_cache=True), slots=2, prompt_width=4)
