"""decode.py end to end (in-process `main`): text / id / chat prompts, length buckets, streamed output,
--compare-ar summary, --resume after a killed write, and its clear errors on bad input."""
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from decoding_fixtures import CFG, make_params

import sbd_jax
from brute import brute_force_generate
from sbd_jax.decoding import DecodeSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import decode  # noqa: E402

WORDS = ["user", "assistant"] + [f"w{i}" for i in range(60)]  # ids 0..61; 62 = [UNK], 63 = mask
TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}" \
           "{% if add_generation_prompt %}assistant{% endif %}"
FLAGS = ["--block-size", "4", "--max-new-tokens", "18", "--gamma", "2.0", "--batch-size", "4",
         "--pad-multiple", "8", "--no-progress"]


def _write_tokenizer(d: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {w: i for i, w in enumerate(WORDS)} | {"[UNK]": 62, "<mask>": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("decode_model") / "m"
    sbd_jax.save_pretrained(CFG, make_params(), d)
    _write_tokenizer(d)
    return d


PROMPTS = [
    {"id": "t1", "prompt": "w1 w2 w3 w4 w5"},
    {"id": "t2", "prompt_ids": [7, 8, 9]},
    {"id": 3, "messages": [{"role": "user", "content": "w10 w11"}]},  # chat template -> 4 tokens
    {"id": "t4", "prompt": "w20 w21 w22 w23 w24 w25 w26", "chat": False},
    {"id": "t5", "prompt": "w30", "chat": True},                       # -> "user w30 assistant"
    {"id": "t6", "prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8]},
]
EXPECTED_IDS = {"t1": [3, 4, 5, 6, 7], "t2": [7, 8, 9], 3: [0, 12, 13, 1], "t4": list(range(22, 29)),
                "t5": [0, 32, 1], "t6": [1, 2, 3, 4, 5, 6, 7, 8]}


def _write_jsonl(path: Path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    inp = _write_jsonl(d / "in.jsonl", PROMPTS)
    out = d / "out.jsonl"
    rc = decode.main(["--model", str(model_dir), "--input", str(inp), "--output", str(out), "--compare-ar",
                      "--summary", str(d / "summary.json"), "--bandwidth", *FLAGS])
    assert rc == 0
    return inp, out, json.loads((d / "summary.json").read_text())


def test_decode_cli_outputs_and_summary(first_run, capsys):
    _, out, summary = first_run
    rows = _read(out)
    assert sorted(map(str, (r["id"] for r in rows))) == sorted(str(p["id"]) for p in PROMPTS)
    params = make_params()
    for r in rows:
        ids = EXPECTED_IDS[r["id"]]
        assert r["prompt_tokens"] == len(ids), r["id"]
        for mode, got in (("sbd", r), ("ar", r["ar"])):
            ref = brute_force_generate(params, CFG, np.asarray([ids + [0] * (8 - len(ids))]), [len(ids)],
                                       max_new_tokens=18, block_size=4, gamma=2.0, mode=mode, eos_ids=())
            assert got["tokens"] == np.asarray(ref.tokens)[0].tolist(), (r["id"], mode)
            assert got["nfe"] == int(ref.nfe[0]) and got["n_tokens"] == 18 and got["stop"] == "length"
        assert r["text"] == " ".join(WORDS[t] if t < 62 else "[UNK]" for t in r["tokens"])
    assert summary["rows"] == 6 and summary["tokens"] == 6 * 18
    assert summary["ar"]["nfe"] == 6 * 18 and summary["nfe"] == sum(r["nfe"] for r in rows)
    assert 1.0 < summary["tokens_per_forward"] < 4.0
    hist = summary["accepted_per_forward"]  # forwards that accepted 0..k tokens, over every row
    assert sum(hist) == summary["nfe"] and sum(n * c for n, c in enumerate(hist)) == summary["tokens"]
    assert "tokens accepted per forward" in decode.format_summary(summary)
    assert summary["speedup_tokens_per_s"] > 0 and summary["tokens_per_s"] > 0
    assert summary["command"].startswith("python decode.py")
    # --bandwidth: every weight read once per batched model call (float32 here), over the measured copy bandwidth
    n_params = sum(x.size for x in jax.tree.leaves(params))
    for s in (summary, summary["ar"]):
        bw = s["bandwidth"]
        assert bw["weight_bytes_per_device"] == 4 * n_params and 0 < s["model_calls"] <= s["nfe"]
        assert bw["achieved_bytes_per_s"] == pytest.approx(bw["weight_bytes_per_device"] * s["model_calls"]
                                                           / s["seconds"], rel=1e-3)
        assert bw["share_of_copy"] == pytest.approx(bw["achieved_bytes_per_s"] / bw["copy_bytes_per_s"])
    assert summary["ar"]["model_calls"] >= 18  # one 1-token step per new token, rows side by side
    assert "ar:  achieved bandwidth" in decode.format_summary(summary)


def test_decode_cli_static_batches_give_the_same_rows(first_run, model_dir, tmp_path):
    """--static (fixed batches, each waiting for its slowest row) and the default continuous slots: same rows."""
    inp, out, summary = first_run
    static = tmp_path / "static.jsonl"
    assert decode.main(["--model", str(model_dir), "--input", str(inp), "--output", str(static), "--compare-ar",
                        "--static", "--summary", str(tmp_path / "s.json"), *FLAGS]) == 0
    by_id = lambda p: {str(r["id"]): r for r in _read(p)}  # noqa: E731
    assert by_id(static) == by_id(out)
    s = json.loads((tmp_path / "s.json").read_text())
    assert summary.get("continuous") and not s.get("continuous")
    assert (s["nfe"], s["tokens"], s["accepted_per_forward"]) == (summary["nfe"], summary["tokens"],
                                                                   summary["accepted_per_forward"])


def test_decode_cli_ctrl_c_leaves_a_resumable_output(first_run, model_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C mid-run: a clean message (no traceback), every written row complete, --resume finishes the rest."""
    inp, out, _ = first_run
    part = tmp_path / "part.jsonl"
    from sbd_jax.decoding import prompts as prompts_mod
    write_row, calls = prompts_mod.write_row, []

    def interrupted(f, row):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(row["id"])
        write_row(f, row)
    monkeypatch.setattr(prompts_mod, "write_row", interrupted)
    assert decode.main(["--model", str(model_dir), "--input", str(inp), "--output", str(part), *FLAGS]) == 130
    assert "interrupted: every row in" in capsys.readouterr().err and len(_read(part)) == 2
    monkeypatch.setattr(prompts_mod, "write_row", write_row)
    assert decode.main(["--model", str(model_dir), "--input", str(inp), "--output", str(part), "--resume", *FLAGS]) == 0
    assert sorted(str(r["id"]) for r in _read(part)) == sorted(str(p["id"]) for p in PROMPTS)


def test_decode_cli_resume_refuses_changed_settings(first_run, model_dir, tmp_path, capsys):
    """--resume under other decoding settings names each change; --allow-change accepts one on purpose."""
    inp, out, _ = first_run
    part = tmp_path / "part.jsonl"
    part.write_text("".join(out.read_text().splitlines(keepends=True)[:2]))
    (tmp_path / "part.jsonl.settings.json").write_text(Path(f"{out}.settings.json").read_text())
    run = ["--model", str(model_dir), "--input", str(inp), "--output", str(part), "--resume", "--compare-ar"]
    flags = [f if f != "2.0" else "1.0" for f in FLAGS]  # --gamma 1.0
    msg = _err(capsys, run + flags)
    assert "was written with other settings (gamma: 2.0 there, 1.0 now)" in msg and len(_read(part)) == 2
    assert decode.main(run + flags + ["--allow-change", "gamma"]) == 0 and len(_read(part)) == 6
    # speed-only settings are no change: the commit quorum moves no row
    assert decode.main(run + flags + ["--commit-quorum", "1.0"]) == 0
    assert "commit_quorum must be in [0, 1]" in _err(capsys, run + flags + ["--commit-quorum", "1.5"])
    assert decode.build_parser().parse_args(run).commit_quorum == DecodeSpec().commit_quorum


def test_decode_cli_per_prompt_max_new_tokens(model_dir, tmp_path, capsys):
    """A line's "max_new_tokens" caps that row (the run's --max-new-tokens sizes the cache); more than the run's
    is an error naming the line."""
    caps = {"a": 5, "b": 18, "c": 1}
    inp = _write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt_ids": [7, 8, 9], "max_new_tokens": c}
                                               for i, c in caps.items()])
    out = tmp_path / "out.jsonl"
    assert decode.main(["--model", str(model_dir), "--input", str(inp), "--output", str(out), *FLAGS]) == 0
    params = make_params()
    for r in _read(out):
        ref = brute_force_generate(params, CFG, np.asarray([[7, 8, 9]]), [3], max_new_tokens=caps[r["id"]],
                                   block_size=4, gamma=2.0, eos_ids=())
        assert r["n_tokens"] == caps[r["id"]] and r["tokens"] == np.asarray(ref.tokens)[0].tolist()
        assert r["nfe"] == int(ref.nfe[0])
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"id": "x", "prompt_ids": [7], "max_new_tokens": 19}])
    msg = _err(capsys, ["--model", str(model_dir), "--input", str(bad), "--output", str(tmp_path / "o2"), *FLAGS])
    assert "prompt 'x' (line 1) asks for max_new_tokens 19, more than the run's 18" in msg


def test_decode_cli_resume_after_partial_line(first_run, model_dir, tmp_path, capsys):
    inp, out, _ = first_run
    full = out.read_text().splitlines(keepends=True)
    part = tmp_path / "out.jsonl"
    part.write_text("".join(full[:3]) + full[3][: len(full[3]) // 2])  # killed mid-line
    (tmp_path / "out.jsonl.settings.json").write_text(Path(f"{out}.settings.json").read_text())
    rc = decode.main(["--model", str(model_dir), "--input", str(inp), "--output", str(part), "--resume",
                      "--compare-ar", *FLAGS])
    assert rc == 0
    assert "3 of 6 prompts already" in capsys.readouterr().err
    text = part.read_text()
    assert text.endswith("\n")
    got = {str(r["id"]): r for r in _read(part)}  # every line parses: no half line left
    assert len(got) == 6 and len(text.splitlines()) == 6
    want = {str(r["id"]): r for r in _read(out)}
    assert got == want  # same results as the uninterrupted run (greedy, per-id keys)
    # everything done: nothing to decode
    assert decode.main(["--model", str(model_dir), "--input", str(inp), "--output", str(part), "--resume",
                        "--compare-ar", *FLAGS]) == 0
    assert "nothing to do" in capsys.readouterr().out
    # an existing output without --resume / --overwrite is refused
    assert decode.main(["--model", str(model_dir), "--input", str(inp), "--output", str(part), *FLAGS]) == 2
    assert "--resume" in capsys.readouterr().err


def _err(capsys, argv):
    rc = decode.main(argv)
    assert rc == 2
    return capsys.readouterr().err


def test_decode_cli_errors(model_dir, tmp_path, capsys):
    out = str(tmp_path / "o.jsonl")
    base = ["--model", str(model_dir), "--output", out, "--no-progress"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert "holds no prompts (empty)" in _err(capsys, base + ["--input", str(empty)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "w1"}\n{"id": 2, "prompt": \n')
    assert "line 2: not valid JSON" in _err(capsys, base + ["--input", str(bad)])
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"id": 1, "prompt": "w1"}\n{"id": 2, "prompt": "caf\xe9"}\n')
    assert "latin.jsonl: line 2: not UTF-8 text (byte 0xe9 at column 25)" in _err(capsys, base + ["--input", str(latin)])
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in model_dir.iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes())
    (corrupt / "tokenizer.json").write_text("{not json")
    assert "cannot read tokenizer" in _err(capsys, ["--model", str(corrupt), "--output", out, "--input", str(bad)])
    nokey = _write_jsonl(tmp_path / "nokey.jsonl", [{"id": 1, "text": "w1"}])
    assert "line 1: needs exactly one of 'prompt'" in _err(capsys, base + ["--input", str(nokey)])
    good = _write_jsonl(tmp_path / "good.jsonl", PROMPTS[:2])
    assert "gamma must be >= 0" in _err(capsys, base + ["--input", str(good), "--gamma", "-0.5"])
    assert "block_size must be >= 1" in _err(capsys, base + ["--input", str(good), "--block-size", "0"])
    assert "quantize='int5' is not a known scheme" in _err(capsys, base + ["--input", str(good), "--quantize", "int5"])
    assert "int4 group size 3 does not divide" in _err(capsys, base + ["--input", str(good), "--quantize", "int4-g3"])
    long = _write_jsonl(tmp_path / "long.jsonl", [{"id": "big", "prompt_ids": [1] * 120}])
    msg = _err(capsys, base + ["--input", str(long), "--max-new-tokens", "18"])
    assert "prompt 'big' (line 1) has 120 tokens" in msg and "max_position_embeddings 128" in msg
    oov = _write_jsonl(tmp_path / "oov.jsonl", [{"id": 1, "prompt_ids": [1, 64]}])
    assert "line 1: token ids must be in [0, 64)" in _err(capsys, base + ["--input", str(oov)])
    # a model without a mask token: SBD refused, AR accepted as far as option checks go
    nomask = tmp_path / "nomask"
    sbd_jax.save_pretrained(sbd_jax.ModelConfig(**{**CFG.__dict__, "mask_token_id": None}), make_params(), nomask)
    assert "no mask_token_id" in _err(capsys, ["--model", str(nomask), "--output", out, "--input", str(good)])
    # text prompt but no tokenizer in that model dir
    assert "needs tokenizer.json" in _err(capsys, ["--model", str(nomask), "--output", out, "--input", str(good),
                                                   "--mode", "ar"])
    # chat requested, tokenizer without template
    (nomask / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    chat = _write_jsonl(tmp_path / "chat.jsonl", [PROMPTS[2]])
    assert "has none" in _err(capsys, ["--model", str(nomask), "--output", out, "--input", str(chat), "--mode", "ar"])
    assert not Path(out).exists()  # no error left a partial output behind


def test_decode_cli_mesh_options(model_dir, tmp_path, capsys):
    """The mesh options of train.py (mesh.x=N overrides) and the --mesh-* flags (which win)."""
    from sbd_jax.sharding import MeshConfig
    parse = decode.build_parser().parse_args
    req = ["--model", "m", "--input", "i", "--output", "o"]
    assert decode.mesh_config(parse(req + ["mesh.tensor=2", "mesh.data=4"])) == MeshConfig(data=4, fsdp=1, tensor=2)
    assert decode.mesh_config(parse(req + ["mesh.tensor=2", "--mesh-tensor", "1"])) == MeshConfig(tensor=1)
    good = _write_jsonl(tmp_path / "good.jsonl", PROMPTS[:1])
    base = ["--model", str(model_dir), "--input", str(good), "--output", str(tmp_path / "o.jsonl"), "--no-progress"]
    assert "only mesh.data=" in _err(capsys, base + ["steps=3"])
    assert "needs 3 devices" in _err(capsys, base + ["mesh.data=3"])  # 1 CPU device here


def test_flags_are_the_dataclasses_fields_with_their_defaults():
    """decode.py's decoding flags are DecodeSpec / DecodeOptions fields by name, each default read from the
    dataclass (defined once); every other field of theirs is named as set another way."""
    import dataclasses

    from sbd_jax.decoding.runner import DecodeOptions
    spec_fields = {f.name: f.default for f in dataclasses.fields(DecodeSpec)}
    option_fields = {f.name: f.default for f in dataclasses.fields(DecodeOptions)}
    assert set(decode.SPEC_FLAGS) | set(decode.SPEC_NOT_FLAGS) == set(spec_fields)
    assert set(decode.OPTION_FLAGS) | {"spec", "continuous"} == set(option_fields)  # (continuous: --static)
    args = decode.build_parser().parse_args(["--model", "m", "--input", "i", "--output", "o"])
    for name in decode.SPEC_FLAGS + decode.OPTION_FLAGS:
        assert getattr(args, name) == {**spec_fields, **option_fields}[name], name
    assert (not args.static) == option_fields["continuous"]
    args = decode.build_parser().parse_args(["--model", "m", "--input", "i", "--output", "o", "--block-size", "4",
                                             "--top-p", "0.5", "--seed", "3", "--verify"])
    assert (args.block_size, args.top_p, args.seed, args.verify) == (4, 0.5, 3, True)
