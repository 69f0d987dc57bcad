"""`make demo-real-eval`: the committed SBD LoRA adapter (trained on a GPU, adapters/) on the installed SmolLM2,
decoded here on the first held-out functions of the GPU run: the completions must be the GPU's token for token
(AR and lossless; the run's own recorded outputs), lossless must equal AR, and a corpus other than the run's is
refused. (The lossy rows go through the same code; their figures on more functions: BENCHMARKS.md.)"""
import json

import pytest

from sbd_jax.config import ConfigError
from demos.real import reproduce


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("real_eval")


def test_the_committed_adapter_decodes_as_on_the_gpu(out):
    rows = reproduce.reproduce(out_dir=str(out), limit=2, batch=2, latency=False, log=lambda *_: None,
                               select=lambda d: d.mode == "ar" or d.verify)
    by = {(r["mode"], r["verify"]): r for r in rows}
    assert set(by) == {("ar", False), ("sbd", True)}
    for r in rows:
        assert r["n_heldout"] == 2 and r["tokens"] > 0
        if r["same_as_gpu"] == 1.0:  # the same completions score the same
            assert (r["first_line_exact"], r["similarity"]) == (r["gpu"]["first_line_exact"], r["gpu"]["similarity"])
    assert by["ar", False]["same_as_gpu"] == 1.0 and by["sbd", True]["same_as_gpu"] == 1.0
    assert by["sbd", True]["same_as_ar"] == 1.0
    gpu_order = list(reproduce.load_record(reproduce.ADAPTER)["rows"][0]["outputs"])  # the GPU run's functions
    assert json.loads((out / "compare.json").read_text())["functions"] == gpu_order[:2]
    table = (out / "compare.md").read_text()
    assert all(r["label"] in table for r in rows)


def test_another_corpus_is_refused(out, tmp_path):
    rec = reproduce.load_record(reproduce.ADAPTER)
    fake = tmp_path / "adapter"
    fake.mkdir()
    (fake / reproduce.RECORD).write_text(json.dumps({**rec, "corpus": {**rec["corpus"], "fingerprint": "0" * 64,
                                                                       "python": "cpython-3.12.9"}}))
    with pytest.raises(ConfigError, match="cpython-3.12.9"):  # refused before any model is loaded
        reproduce.reproduce(fake, str(out), limit=1, log=lambda *_: None)
