"""Continuous batching (sbd_jax/decoding/continuous.py): `decode_stream`. That each row
equals the same prompt decoded alone by `generate` (whatever its slot and neighbours, for SBD, AR and verify, with
ragged prompts, per-row caps, EOS and sampling) and that a stream longer than the slots runs on the same compiled
programs: tests/test_rows_alone.py."""
import numpy as np
from decoding_fixtures import CFG

from sbd_jax.decoding import DecodeSpec, generate
from sbd_jax.decoding.continuous import decode_stream


def test_decode_stream(params):
    spec = DecodeSpec(max_new_tokens=6, block_size=4, eos_ids=())
    got = dict(decode_stream(params, CFG, [[1, 2, 3], [4], [5, 6]], spec, slots=2, prompt_width=4, gamma=2.0))
    for i, ids in enumerate([[1, 2, 3], [4], [5, 6]]):
        ref = generate(params, CFG, np.asarray([ids + [0] * (4 - len(ids))]), [len(ids)], spec, gamma=2.0)
        assert got[i].tokens == np.asarray(ref.tokens)[0].tolist()
