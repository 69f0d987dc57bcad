"""The demo: task-suite properties, and the --quick pipeline end to end (table shape and sanity)."""
import dataclasses
import json

import numpy as np
import pytest
from conftest import xla_optimized

from sbd_jax.config import ConfigError
from demos.toy import tasks
from demos.toy.evaluation import decoders
from demos.toy import pipeline
from demos.toy.pipeline import DemoConfig, run
from demos.toy.tokenizer import build_tokenizer


def test_task_suite_is_deterministic_disjoint_and_self_consistent():
    a = tasks.generate(300, "train", 0)
    assert a == tasks.generate(300, "train", 0)
    test = tasks.generate(300, "test", 0)
    assert not {p.prompt for p in a} & {p.prompt for p in test}
    assert {p.family for p in test} == set(tasks.FAMILIES)
    for p in a + test:
        assert tasks.extract_answer(p.solution) == p.answer
    # answers are the real results: recompute the list tasks independently
    for p in test:
        if p.family in ("rev", "sort", "sum"):
            xs = [int(c) for c in p.prompt.split("\n")[0].split()[1:]]
            want = {"rev": " ".join(map(str, xs[::-1])), "sort": " ".join(map(str, sorted(xs))),
                    "sum": str(sum(xs))}[p.family]
            assert p.answer == want
        if p.family == "trace":  # run the program
            env = {}
            for stmt in p.prompt.split("\n")[0].removeprefix("Q:run ").split(";"):
                dst, expr = stmt.split("=")
                env[dst] = last = eval(expr, {}, dict(env))
            assert p.answer == str(last)


def test_tokenizer_trained_on_training_text_round_trips_and_keeps_numbers_whole():
    train, test = tasks.generate(2000, "train", 0), tasks.generate(200, "test", 0)
    tok = build_tokenizer((p.text for p in train), vocab_size=512)
    assert all(tok.decode(tok.encode(p.text).ids) == p.text for p in test)  # lossless on unseen problems
    assert tok.decode(tok.encode("any text ~ {ok} 12345").ids) == "any text ~ {ok} 12345"  # printable fallback
    # numbers of up to 3 digits are one token each (as in Llama-3 / Qwen): "13+4=17" -> 13 + 4 = 17
    assert tok.encode("13+4=17;").tokens == ["13", "+", "4", "=", "17", ";"]
    assert tok.encode("Q:sum 4 7").tokens == ["Q", ":", "sum", " 4", " 7"]
    assert build_tokenizer((p.text for p in train), vocab_size=512).to_str() == tok.to_str()  # deterministic


def test_quick_pipeline_end_to_end(tmp_path, capsys, monkeypatch):
    # the --quick pipeline with fewer steps and problems: every stage and table column, in a fraction of the time.
    # Smaller batches at a higher learning rate: the SBD fine-tune's MATP stream still learns enough that gamma=3
    # makes ~1.7-1.9 tokens per forward (seeds 0 and 1; the mean of the two gammas' must pass 1). The batch pass
    # runs 8 slots over the 16 problems (slots refilled, as in decode.py). One lossless row: "always" (half the
    # compile time of "adaptive", which tests/test_verify.py, test_draft_policy.py and test_user_path.py cover).
    cfg = DemoConfig.quick(out_dir=str(tmp_path / "demo"), pretrain_steps=100, finetune_steps=80, batch_size=8,
                           pretrain_lr=4e-3, finetune_lr=4e-3, n_test=16, eval_batch=8, lossless_policies=("always",))
    evaluate = pipeline.evaluate

    def evaluate_unoptimized(*a, **kw):
        with xla_optimized(False):  # its programs run for a fraction of a second each
            return evaluate(*a, **kw)
    monkeypatch.setattr(pipeline, "evaluate", evaluate_unoptimized)
    rows = run(cfg, log=lambda *a: None)
    assert [r["label"] for r in rows] == [s.label for s in decoders(cfg)]
    base = rows[0]
    assert base["mode"] == "ar" and base["tokens_per_forward"] == 1.0  # AR: one token per forward
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["n"] == cfg.n_test and r["tokens_per_s"] > 0
    sbd = [r for r in rows if r["mode"] == "sbd" and r["rule"] == "eb" and not r["verify"]]
    assert len(sbd) == len(cfg.gammas)
    lossless = [r for r in rows if r["verify"]]
    assert [r["policy"] for r in lossless] == list(cfg.lossless_policies) and rows[1]["same_as_sbd_ar"] == 1.0
    assert all(r["gamma"] is None and r["rule"] is None for r in lossless)  # no gamma or rule in verify mode
    for r in lossless:  # the SBD model's AR output, up to float near-ties of the two forward shapes
        assert r["same_as_sbd_ar"] >= 0.95 and abs(r["accuracy"] - rows[1]["accuracy"]) <= 0.05, r
        assert sum(r["accepted_per_forward"]) > 0
    assert len([r for r in rows if r["rule"] == "threshold"]) == len(cfg.threshold_gammas)
    for r in rows:  # the batch-1 (latency) pass: timed, and the same tokens as in the batch
        assert r["latency_n"] == min(cfg.latency_n, cfg.n_test) and r["latency_tokens_per_s"] > 0
        assert r["latency_same_as_batch"] >= 0.9
        # timing rounds: every decoder timed cfg.timing_rounds times; tokens/s from the median round
        assert len(r["seconds_rounds"]) == len(r["latency_seconds_rounds"]) == cfg.timing_rounds == 2
        assert r["seconds"] == pytest.approx(float(np.median(r["seconds_rounds"])))
        assert r["latency_seconds"] == pytest.approx(float(np.median(r["latency_seconds_rounds"])))
    assert np.mean([r["tokens_per_forward"] for r in sbd]) > 1.0  # SBD makes more than one token per forward
    assert sbd[-1]["tokens_per_forward"] >= sbd[0]["tokens_per_forward"]  # larger gamma -> more per step
    out = tmp_path / "demo"
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["rows"]) == len(rows)
    main, families = (out / "table.md").read_text().strip().split("\n\nAccuracy per task family:\n\n")
    assert len(main.splitlines()) == 2 + len(rows)
    assert main.splitlines()[0].count("|") == 11  # 10 columns: accuracy, = AR, NFE and two wall-clock settings
    assert len(families.splitlines()) == 2 + len(rows)
    assert families.splitlines()[0].count("|") == 2 + len(tasks.FAMILIES)
    assert (out / "accuracy_vs_speedup.png").stat().st_size > 10_000
    # rerun: every stage is reused (no retraining), same table
    rows2 = run(cfg, log=lambda *a: None)
    assert [r["accuracy"] for r in rows2] == [r["accuracy"] for r in rows]
    # a rerun with other training settings refuses to reuse the stale stage, naming the difference
    with pytest.raises(ConfigError, match=r"ft_ntp was made with other settings \(.*steps: 80 there, 81 now"):
        run(dataclasses.replace(cfg, finetune_steps=81), log=lambda *a: None)
    with pytest.raises(ConfigError, match=r"data was made with other settings \(n_test: 16 there, 17 now"):
        run(dataclasses.replace(cfg, n_test=17), log=lambda *a: None)
    with pytest.raises(ConfigError, match="timing_rounds must be >= 1"):
        DemoConfig.quick(timing_rounds=0)
    # the diagnostics script runs on the finished run's output
    from demos.toy import diagnose
    capsys.readouterr()
    with xla_optimized(False):
        diagnose.main([str(out), "--n", "8", "ar:1:0:eb", "sbd:4:0.35:threshold"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    for head, errs in zip(lines[0::2], lines[1::2]):
        assert "accuracy" in head and "tokens/forward" in head
        acc = float(head.split("accuracy")[1].split("%")[0])
        n_wrong = int(errs.split("of the ")[1].split(" wrong")[0])
        assert n_wrong == round(8 * (1 - acc / 100))  # every wrong answer is classified once
        assert sum(int(part.rsplit(" ", 1)[1]) for part in errs.split(": ", 1)[1].split(", ")) == n_wrong


def test_first_error_kind_classifies_where_a_solution_goes_wrong():
    from demos.toy.diagnose import first_error_kind
    sol = ["4", "+", "1", "=", "5", ";", "5", "-", "4", "=", "1", ";", "=", "1"]
    gold = list(range(len(sol)))

    def wrong_at(j):
        return gold[:j] + [99] + gold[j + 1:]
    assert first_error_kind(wrong_at(4), gold, sol) == "computed value"   # 4+1=[5]
    assert first_error_kind(wrong_at(10), gold, sol) == "computed value"  # 5-4=[1]
    assert first_error_kind(wrong_at(6), gold, sol) == "copied number"    # ;[5]-4
    assert first_error_kind(wrong_at(13), gold, sol) == "final answer"    # ;=[1]
    assert first_error_kind(wrong_at(5), gold, sol) == "structure"
    assert first_error_kind(gold[:7], gold, sol) == "stopped early"
    assert first_error_kind(gold + [3], gold, sol) == "ran on"


def test_lossless_policies_are_checked():
    assert [d.policy for d in decoders(DemoConfig()) if d.verify] == ["adaptive", "always"]
    with pytest.raises(ConfigError, match="'sometimes'"):
        DemoConfig.quick(lossless_policies=("adaptive", "sometimes"))
    with pytest.raises(ConfigError, match="lossless_policies"):
        DemoConfig(lossless_policies="adaptive")  # a bare name, not a tuple of them
