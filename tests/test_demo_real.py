"""`make demo-real` end to end at a tiny setting on the CPU: a tiny random GGUF that carries SmolLM2's real
tokenizer (vocabulary, merges, chat template), a dozen real stdlib modules, two fine-tunes of two steps, every
decoder on a few held-out functions and HumanEval problems. Every stage runs; the numbers mean nothing, but
the lossless rows must equal AR's tokens, and a rerun reuses every stage or names what changed."""
import json
from pathlib import Path

import pytest
from gguf_fixtures import make_tiny_gguf

from sbd_jax.config import ConfigError
from sbd_jax.demo_real import corpus
from sbd_jax.demo_real.config import RealDemoConfig
from sbd_jax.demo_real.evaluation import decoders
from sbd_jax.demo_real.pipeline import run
from sbd_jax.io.real_model import gguf_path


def _some_stdlib(dest, n_train=8, n_heldout=4):
    """A few real stdlib modules of both sides of the split (the corpus's own rule decides the side)."""
    picked = {"train": [], "heldout": []}
    for mod in corpus.load().modules:
        side = picked[mod.split]
        if len(side) < (n_train if mod.split == "train" else n_heldout) and 2_000 < len(mod.source) < 60_000:
            side.append(mod)
    for mod in picked["train"] + picked["heldout"]:
        (dest / mod.path).parent.mkdir(parents=True, exist_ok=True)
        (dest / mod.path).write_text(mod.source)
    return dest


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo_real")
    gguf = make_tiny_gguf(tmp / "tiny.gguf", tokenizer_from=gguf_path(), quant="Q8_0")
    # wide_cost: a stated cost, no per-shape measurement in the suite; eval_batch 8 >= the 5 prompts: one admission
    # program per decoder (at 4: admissions of 4 and of 1)
    cfg = RealDemoConfig.quick(out_dir=str(tmp / "out"), gguf=str(gguf), corpus_root=str(_some_stdlib(tmp / "lib")),
                               steps=2, n_heldout=3, per_module=4, n_humaneval=2, threshold_gammas=(), latency_n=0,
                               wide_cost=4.0, eval_batch=8)
    logs = []
    rows = run(cfg, log=logs.append)  # 2 steps, a few dozen tokens: compiled unoptimized (conftest.py)
    return cfg, rows, logs


def test_every_stage_runs_and_lossless_rows_equal_ar(demo):
    cfg, rows, logs = demo
    out = cfg.out_dir
    for f in ("table.md", "results.json", "quality_vs_speedup.png", "data/train.jsonl", "data/heldout.jsonl",
              "data/humaneval.jsonl", "ft_ntp/hf/config.json", "ft_sbd/hf/config.json"):
        assert (Path(out) / f).is_file() and (Path(out) / f).stat().st_size > 0, f
    res = json.loads((Path(out) / "results.json").read_text())
    assert res["corpus"]["fingerprint"] == corpus.load(cfg.corpus_root).fingerprint
    assert res["corpus"]["examples"]["heldout"] == cfg.n_heldout and res["corpus"]["examples"]["humaneval"] == 2
    assert [r["label"] for r in rows] == [d.label for d in decoders(cfg)]
    done = {n: json.loads((Path(out) / f"ft_{n}" / "DONE").read_text()) for n in ("ntp", "sbd")}
    assert not done["ntp"]["last"].get("matp_loss") and done["sbd"]["last"]["matp_loss"] > 0
    for r in rows:
        assert r["n_heldout"] == cfg.n_heldout and r["n_humaneval"] == 2
        for key in ("first_line_exact", "similarity", "parses", "humaneval_pass1"):
            assert 0.0 <= r[key] <= 1.0, (r["label"], key)
        assert r["tokens"] > 0 and r["nfe"] > 0 and r["tokens_per_s"] > 0 and r["latency_n"] == 0
        if r["mode"] == "ar":
            assert r["tokens_per_forward"] == 1.0 and r["same_as_ar"] == 1.0
        if r["verify"]:  # lossless: the SBD fine-tune's own AR tokens, whatever its drafts
            assert r["same_as_ar"] == 1.0, r["label"]
    assert [r["policy"] for r in rows if r["verify"]] == list(cfg.lossless_policies)
    table = (Path(out) / "table.md").read_text()
    assert all(r["label"] in table for r in rows) and "HumanEval pass@1" in table


def test_rerun_reuses_every_stage_and_refuses_other_settings(demo):
    cfg, rows, _ = demo
    logs = []
    assert json.dumps(run(cfg, log=logs.append)) == json.dumps(rows)  # (NaN latency columns: compared as JSON)
    for stage in ("[data] reusing", "[ft_ntp] reusing", "[ft_sbd] reusing", "[eval] reusing"):
        assert any(line.startswith(stage) for line in logs), stage
    with pytest.raises(ConfigError, match="steps"):
        run(RealDemoConfig(**{**cfg.__dict__, "steps": 3}), log=lambda *_: None)
    with pytest.raises(ConfigError, match="n_heldout"):
        run(RealDemoConfig(**{**cfg.__dict__, "n_heldout": 2}), log=lambda *_: None)


def test_quick_config_checks():
    with pytest.raises(ConfigError, match="prompt_tokens"):
        RealDemoConfig(prompt_tokens=700, seq_len=640)
    with pytest.raises(ConfigError, match="remat"):
        RealDemoConfig(remat="some")
    with pytest.raises(ConfigError, match="'sometimes'"):
        RealDemoConfig.quick(lossless_policies=("sometimes",))
