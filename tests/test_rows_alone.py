"""Batch invariance, for every decoding engine and mode: each row of a batched decoding equals its prompt decoded
alone by `generate` - the same tokens, length, stop (EOS or cap), NFE and accepted-draft histogram - whatever
its neighbours, its padding (width and content), its slot and when it was admitted.

  * engine "generate": a ragged batch (garbage in the padding) with per-row keys, per-row caps
    (`row_max_new_tokens`) and an EOS the model emits (rows stop by EOS, by their cap and at max_new_tokens);
    each row alone has its cap as the spec's `max_new_tokens` (so a row cap decodes as a spec cap) and its prompt
    padded to the batch's width with other garbage (the last row: unpadded), greedy and sampled.
  * engine "continuous" (sbd_jax/decoding/continuous.py): 13 requests of 1-8 tokens with their own keys and caps
    and an EOS the rows emit, through 3 slots: plain, with `prefill_chunk` and with admissions of at most 2 rows;
    each row alone is its prompt right-padded to the decoder's prompt width with its cap as `row_max_new_tokens`. A stream
    longer than the slots runs on the same compiled programs, and a second decoder compiles nothing.

Modes: "sbd" (lossy SBD, entropy-bounded rule), "ar" and "verify" (lossless SBD: drafts verified by AR)."""
import jax
import numpy as np
import pytest

from decoding_fixtures import BASE, CFG, LENGTHS, MAX_NEW, B, make_prompts, pick_eos
from sbd_jax.decoding import DecodeSpec, generate
from sbd_jax.decoding.continuous import ContinuousDecoder, Request

# verify: every call drafting at the widest width, so a row's calls are its own (the adaptive policy decides per batch: its calls
# depend on the neighbours, its tokens do not - tests/test_verify.py)
MODES = {"sbd": dict(mode="sbd"), "ar": dict(mode="ar"), "verify": dict(mode="sbd", verify=True, draft_policy="always")}
GAMMA = {"sbd": 2.0, "ar": 2.0, "verify": 3.0}
TEMPERATURE = {"greedy": 0.0, "sampled": 1.0}
# per-row max_new_tokens. With each mode's EOS every case has a row stopped by EOS (row 0), one that decodes all
# max_new_tokens (row 1 or 2) and one stopped by its row cap inside a block (row 3: 3 is not a multiple of k).
CAPS = np.array([18, 18, 18, 3], np.int32)
CASES = [("generate", m, s) for m in MODES for s in TEMPERATURE] + [("continuous", m, "sampled") for m in MODES]


def _row(tokens, n, nfe, eos, accepted) -> dict:
    """One row's results in the form compared below (`tokens`: the n generated tokens only)."""
    return {"tokens": np.asarray(tokens)[:int(n)].tolist(), "nfe": int(nfe), "stop": "eos" if bool(eos) else "length",
            "accepted": np.asarray(accepted).tolist()}


def _alone(params, ids, length, key, cap, spec=None, cap_as_spec=False, **kw) -> dict:
    """The prompt `ids[:length]` decoded alone by `generate` (batch 1, `ids` its padded row); its cap as the spec's
    `max_new_tokens` or as `row_max_new_tokens`."""
    caps = dict(max_new_tokens=int(cap)) if cap_as_spec else dict(row_max_new_tokens=[int(cap)])
    out = generate(params, CFG, np.asarray([ids], np.int32), [int(length)], spec, key=key[None], **{**kw, **caps})
    return _row(out.tokens[0], out.lengths[0], out.nfe[0], out.stopped_by_eos[0], out.accepted[0])


@pytest.fixture(scope="module")
def eos_of(params, prompts):
    """Per mode: an EOS id the model emits in the ragged batch (tests/test_decoding.py's choice, so these decoders
    are the ones compiled there; verify's greedy tokens are AR's, so verify takes AR's)."""
    eos = {m: pick_eos(generate(params, CFG, prompts, LENGTHS, gamma=2.0, eos_ids=(), **MODES[m], **BASE).tokens)
           for m in ("sbd", "ar")}
    return {**eos, "verify": eos["ar"]}


def _generate_rows(params, prompts, eos_of, mode, temperature):
    """-> (each row of a batched `generate`, that row's prompt decoded alone)."""
    keys = jax.random.split(jax.random.key(11), B)  # per-row keys: sampling independent of the batch
    kw = dict(gamma=GAMMA[mode], temperature=temperature, eos_ids=(eos_of[mode],), **MODES[mode], **BASE)
    out = generate(params, CFG, prompts, LENGTHS, key=keys, row_max_new_tokens=CAPS, **kw)
    toks, n = np.asarray(out.tokens), np.asarray(out.lengths)
    assert (n <= CAPS).all() and not any(toks[b, n[b]:].any() for b in range(B)), "tokens past a row's end"
    eos = np.asarray(out.stopped_by_eos)
    assert eos.any() and (n == MAX_NEW).any() and ((n == CAPS) & (CAPS < MAX_NEW) & ~eos).any(), \
        f"want rows stopped by EOS, by a row cap and at max_new_tokens: lengths {n}, EOS {eos}"
    got = [_row(toks[b], n[b], out.nfe[b], eos[b], out.accepted[b]) for b in range(B)]
    # alone: rows 0-2 at the batch's width with other garbage in their padding (one program: their caps are the
    # spec's), the last row unpadded
    other = make_prompts(garbage_seed=99)
    alone = [_alone(params, other[b] if b < B - 1 else prompts[b, :LENGTHS[b]], LENGTHS[b], keys[b], CAPS[b],
                    cap_as_spec=True, **kw) for b in range(B)]
    return got, alone


def _requests(n, seed=0):
    rng = np.random.default_rng(seed)
    base = jax.random.key(7)
    return [Request(tuple(int(t) for t in rng.integers(0, 62, rng.integers(1, 9))), jax.random.fold_in(base, i),
                    int(rng.integers(1, 19))) for i in range(n)]


def _continuous_rows(params, eos, mode, temperature):
    """-> (each row of three continuous-batching runs, that row's prompt decoded alone), and the checks of the
    runs' programs and stops. `eos`: the mode's EOS of the ragged batch (the rows stop by it and by their caps)."""
    reqs = _requests(13)
    kw = dict(gamma=0.5, temperature=temperature)
    spec = DecodeSpec(**MODES[mode], max_new_tokens=18, block_size=4, eos_ids=(eos,))
    # alone: `generate` on the spec with the cache options of BASE (they change no token, NFE or stop), so the
    # batch-1 decoder is the one the generate engine's rows alone compiled
    alone_spec = DecodeSpec.make(spec, finalize_cache=True, return_cache=True, pad_id=0)
    want = [_alone(params, list(r.ids) + [0] * (8 - len(r.ids)), len(r.ids), r.key, r.max_new_tokens, alone_spec,
                   **kw) for r in reqs]
    assert any(w["stop"] == "eos" for w in want) and any(w["stop"] == "length" for w in want)
    got_all, want_all = [], []
    # prefill_chunk 3: admissions write 1-8 token prompts in as many 3-column pieces as the longest needs
    # admit_rows 2: the first three prompts are admitted by two calls (2 + 1 rows)
    for spec_i, admit in ((spec, 16), (DecodeSpec.make(spec, prefill_chunk=3), 16), (spec, 2)):
        dec = ContinuousDecoder(params, CFG, spec_i, slots=3, prompt_width=8, admit_rows=admit, **kw)
        got = dict(dec.decode(reqs))
        assert sorted(got) == list(range(len(reqs)))
        assert sum(r.n_tokens for r in got.values()) == sum(len(w["tokens"]) for w in want)
        got_all += [{k: getattr(got[i], k) for k in w} for i, w in enumerate(want)]
        want_all += want
        # 13 prompts through 3 slots on one loop program and admission programs for 1, 2 or 4 rows (<= admit)
        allowed = {"empty", "run"} | {f"admit{r}" for r in (1, 2, 4) if r <= admit}
        assert "run" in dec._programs and set(dec._programs) <= allowed, (admit, set(dec._programs))
        assert admit > 2 or "admit2" in dec._programs
        if spec_i == spec:
            first = got
    again = ContinuousDecoder(params, CFG, spec, slots=3, prompt_width=8, **kw)  # a later call: no recompilation
    assert dict(again.decode(reqs)) == first and again.compile_s == 0.0
    return got_all, want_all


@pytest.mark.parametrize("engine, mode, sampling", CASES, ids=["-".join(c) for c in CASES])
def test_each_row_equals_its_prompt_decoded_alone(params, prompts, eos_of, engine, mode, sampling):
    if engine == "generate":
        got, alone = _generate_rows(params, prompts, eos_of, mode, TEMPERATURE[sampling])
    else:
        got, alone = _continuous_rows(params, eos_of[mode], mode, TEMPERATURE[sampling])
    assert len(got) == len(alone)
    for i, (g, a) in enumerate(zip(got, alone)):
        assert g == a, f"{engine} {mode} {sampling}: row {i} differs from its prompt decoded alone"
