"""`make demo` and `make demo-real-eval`: the committed copy-only SBD adapter (adapters/) on the installed SmolLM2,
decoded here on the first held-out functions of its record (their first 32 tokens): the completions must be the
recorded ones token for token (the base's AR and lossless), lossless must equal the base's AR, the plot is written,
and a corpus or a prompt other than the record's is refused. (The lossy rows go through the same code; their figures on more
functions: README.md and BENCHMARKS.md.)"""
import json
import re

import pytest

from sbd_jax.config import ConfigError
from demos.real import reproduce


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("real_eval")


def test_the_committed_adapter_decodes_as_recorded(out):
    rows = reproduce.reproduce(out_dir=str(out), limit=2, batch=2, latency=False, log=lambda *_: None,
                               select=lambda d: d.mode == "ar" or d.verify, max_new=32)  # the first 32 tokens
    by = {(r["mode"], r["verify"]): r for r in rows}
    assert set(by) == {("ar", False), ("sbd", True)}
    for r in rows:
        assert r["n_heldout"] == 2 and r["tokens"] > 0 and r["same_as_record"] == 1.0
        assert (r["first_line_exact"], r["similarity"]) == (r["recorded"]["first_line_exact"],
                                                            r["recorded"]["similarity"])
    assert by["sbd", True]["same_as_base_ar"] == 1.0
    rec = reproduce.load_record(reproduce.ADAPTER)
    assert json.loads((out / "compare.json").read_text())["functions"] == rec["functions"][:2]
    table = (out / "compare.md").read_text()
    assert all(r["label"] in table for r in rows)
    assert (out / "compare.png").stat().st_size > 10_000


def test_another_corpus_is_refused(out, tmp_path):
    rec = reproduce.load_record(reproduce.ADAPTER)
    fake = tmp_path / "adapter"
    fake.mkdir()
    (fake / reproduce.RECORD).write_text(json.dumps({**rec, "corpus": {**rec["corpus"], "fingerprint": "0" * 64,
                                                                       "python": "cpython-3.12.9"}}))
    with pytest.raises(ConfigError, match="cpython-3.12.9"):  # refused before any model is loaded
        reproduce.reproduce(fake, str(out), limit=1, log=lambda *_: None)
    # a held-out function made into another prompt than the recorded one (the task format changed): refused by name
    first = rec["functions"][0]
    (fake / reproduce.RECORD).write_text(json.dumps({**rec, "prompt_digests": {**rec["prompt_digests"], first: "0" * 16}}))
    with pytest.raises(ConfigError, match=re.escape(f"{first!r}: its prompt made here is not the one the record was decoded")):
        reproduce.reproduce(fake, str(out), limit=1, log=lambda *_: None)
    with pytest.raises(ConfigError, match=r"max_new must be in \[1, 128\] \(the record's\), got 0"):
        reproduce.reproduce(reproduce.ADAPTER, str(out), max_new=0, log=lambda *_: None)
