"""Weight-only quantization (sbd_jax/models/quant.py): each scheme's weights against a float64 dequantization of
their own values and scales (the error within the scheme's step), the quantized forward against the float model
holding those float64-dequantized weights, lossless decoding on quantized weights == that quantized model's AR
(greedy and sampled; `generate` and continuous batching; sharded: tests/test_decoding_sharded.py), a LoRA adapter
on a quantized base, quantizing while loading == quantizing after, and the errors that name the option or weight."""
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from decoding_fixtures import CFG, LENGTHS, MAX_NEW, coin_policy, outputs

import sbd_jax
from sbd_jax.attention import clean_meta
from sbd_jax.config import ConfigError
from sbd_jax.io.hf_layout import CheckpointError
from sbd_jax.decoding import DecodeError, DecodeSpec, generate
from sbd_jax.decoding.continuous import decode_stream
from sbd_jax.models import forward
from sbd_jax.models.lora import AdapterLayout, attach, init_adapter
from sbd_jax.models.quant import (QUANTIZED, QUANTIZED_TYPES, Int4Groups, QArray, Quantization, quantization_of,
                                  quantize_params, weight_axes)

SCHEMES = ("int8", "fp8", "int4-g8")  # the test model's head_dim is 8: int4 in groups of 8


def dequantize64(w) -> np.ndarray:
    """The weight in float64 numpy from its stored parts, each scale repeated over its group (not the library's
    code): int8 / fp8 (qwix QArray) values * scale; int4 (Int4Groups) values * scale + low."""
    if isinstance(w, Int4Groups):
        q = np.asarray(w.q).astype(np.float64)
        return q * _expand(np.asarray(w.scale, np.float64), q.shape) + _expand(np.asarray(w.low, np.float64), q.shape)
    q = np.asarray(w.qvalue).astype(np.float64)
    return q * _expand(np.asarray(w.scale, np.float64), q.shape)


def _expand(s: np.ndarray, shape) -> np.ndarray:
    for axis, (n, m) in enumerate(zip(shape, s.shape)):
        if m not in (1, n):
            s = np.repeat(s, n // m, axis=axis)
    return np.broadcast_to(s, shape)


@pytest.fixture(scope="module")
def quantized(params):
    return {s: quantize_params(params, CFG, s) for s in SCHEMES}


def _dequantized_params(qparams):
    """The float model holding the float64 dequantization of `qparams`' weights (as float32)."""
    layers = {k: (jnp.asarray(dequantize64(v), jnp.float32) if isinstance(v, QUANTIZED_TYPES) else v)
              for k, v in qparams["layers"].items()}
    return {**qparams, "layers": layers}


def _meta(T=7):
    return clean_meta(jnp.ones((2, T), jnp.int32), jnp.broadcast_to(jnp.arange(T), (2, T)))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_weights_within_the_schemes_step_and_the_forward_equals_the_dequantized_model(params, quantized, scheme):
    q = Quantization.of(scheme)
    qp = quantized[scheme]
    assert quantization_of(qp) == q and quantization_of(params) is None
    for name in QUANTIZED:
        w, qa = np.asarray(params["layers"][name], np.float64), qp["layers"][name]
        values, scale = (qa.q, qa.scale) if q.scheme == "int4" else (qa.qvalue, qa.scale)
        assert isinstance(qa, Int4Groups if q.scheme == "int4" else QArray)
        assert values.dtype == jnp.dtype(q.qtype) and values.shape == w.shape
        # one scale per layer and output channel; int4 one per group of 8 inputs too
        ins, others = weight_axes(name, w.ndim)
        assert all(scale.shape[a] == w.shape[a] for a in others)
        n_groups = int(np.prod([scale.shape[a] for a in ins]))
        step = _expand(np.asarray(scale, np.float64), w.shape)
        err = np.abs(dequantize64(qa) - w)
        if q.scheme == "int8":
            assert n_groups == 1 and (err <= 0.5 * step + 1e-6).all()
            assert np.allclose(np.abs(w).max(axis=ins, keepdims=True), 127.5 * np.asarray(scale),
                               rtol=1e-6)  # absmax maps to 127.5 (qwix; clipped to 127 within half a step)
        elif q.scheme == "fp8":  # e4m3: 3 mantissa bits, so within 2^-4 of the value (subnormals: 2^-10 scale)
            assert n_groups == 1 and (err <= 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * step + 1e-7).all()
        else:  # 16 steps from each group's minimum to its maximum, both as float16 (rounding: 2^-11 relative)
            lo = w.reshape(w.shape[:ins[-1]] + (w.shape[ins[-1]] // 8, 8) + w.shape[ins[-1] + 1:]).min(axis=ins[-1] + 1)
            assert qa.scale.dtype == qa.low.dtype == jnp.float16
            np.testing.assert_allclose(np.asarray(qa.low, np.float64), lo, rtol=2.0 ** -11)
            slack = 2.0 ** -11 * (np.abs(_expand(lo, w.shape)) + 15 * step)  # the stored low end's and scale's rounding
            assert n_groups == int(np.prod([w.shape[a] for a in ins])) // 8 and (err <= 0.5 * step + slack + 1e-7).all()
        assert err.max() > 0  # really quantized
    toks = jnp.asarray(np.arange(14).reshape(2, 7) % 62)
    got = np.asarray(forward(qp, CFG, toks, _meta())[0])
    ref = np.asarray(forward(_dequantized_params(qp), CFG, toks, _meta())[0])
    full = np.asarray(forward(params, CFG, toks, _meta())[0])
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, atol=2e-5 * scale, rtol=0)
    assert np.abs(full - ref).max() > 100 * np.abs(got - ref).max()  # the comparison can tell the schemes apart


# (scheme, sampling, KV cache): each weight form once, the int8 cache with int8 weights, greedy and sampled (the
# sampled case reuses the greedy one's programs: temperature is an argument of the compiled loop)
CASES = [("fp8", dict(temperature=1.0), None), ("int4-g8", dict(temperature=1.0, top_k=5), None),
         ("int8", dict(temperature=0.0), "int8"), ("int8", dict(temperature=1.0), "int8")]


@pytest.mark.parametrize("scheme,how,kv", CASES, ids=["fp8-t1", "int4-topk", "int8-int8kv-greedy", "int8-int8kv-t1"])
def test_verify_equals_the_quantized_models_ar(quantized, prompts, scheme, how, kv):
    """Lossless decoding on quantized weights (and an int8 KV cache: values + a scale per position and KV head)
    gives exactly that quantized model's AR tokens, in `generate` and continuous batching."""
    qp = quantized[scheme]
    kw = dict(key=jax.random.key(5), max_new_tokens=MAX_NEW, eos_ids=(), kv_cache_dtype=kv, **how)
    ar = generate(qp, CFG, prompts, LENGTHS, mode="ar", return_cache=kv == "int8", **kw)
    v = generate(qp, CFG, prompts, LENGTHS, mode="sbd", verify=True, block_size=4, draft_policy=coin_policy, **kw)
    np.testing.assert_array_equal(outputs(v)["tokens"], outputs(ar)["tokens"])
    assert int(v.wide_steps) > 0  # drafts were checked
    if kv == "int8":
        assert ar.cache.k.dtype == jnp.int8 and ar.cache.k_scale.shape == ar.cache.k.shape[:-1]
    if kv == "int8" and how["temperature"] == 0.0:  # continuous batching, 2 slots for 4 prompts
        spec = DecodeSpec(mode="sbd", verify=True, block_size=4, max_new_tokens=MAX_NEW, eos_ids=(),
                          draft_policy=coin_policy, kv_cache_dtype=kv)
        rows = [list(p[:n]) for p, n in zip(np.asarray(prompts), LENGTHS)]
        got = dict(decode_stream(qp, CFG, rows, spec, slots=2, prompt_width=8, temperature=0.0))
        for i in range(len(rows)):
            one = generate(qp, CFG, np.asarray([rows[i] + [0] * (8 - len(rows[i]))]), [len(rows[i])], mode="ar",
                           max_new_tokens=MAX_NEW, eos_ids=(), temperature=0.0, kv_cache_dtype=kv)
            assert got[i].tokens == np.asarray(one.tokens)[0].tolist(), i


def test_lora_on_a_quantized_base(params, quantized):
    """An adapter's low-rank path is added to the quantized base's product (never merged into it)."""
    qp = quantized["int4-g8"]
    layout = AdapterLayout(rank=2, alpha=4.0, targets=("q", "o", "down"))
    ad = init_adapter(CFG, layout, jax.random.key(1), params)
    ad = jax.tree.map(lambda x: x + 0.3, ad)  # B nonzero: the path contributes
    toks = jnp.asarray(np.arange(14).reshape(2, 7) % 62)
    got = np.asarray(forward(attach(qp, ad, layout), CFG, toks, _meta())[0])
    ref = np.asarray(forward(attach(_dequantized_params(qp), ad, layout), CFG, toks, _meta())[0])
    base = np.asarray(forward(qp, CFG, toks, _meta())[0])
    np.testing.assert_allclose(got, ref, atol=2e-5 * np.abs(ref).max(), rtol=0)
    assert np.abs(got - base).max() > 1e-2


def test_loading_quantized_equals_quantizing_after(params, tmp_path):
    """from_pretrained(quantize=) quantizes one layer's weight at a time: the same arrays as quantizing the loaded
    model; Sampler.load holds only quantized projections."""
    d = tmp_path / "m"
    sbd_jax.save_pretrained(CFG, params, d)
    cfg, full = sbd_jax.from_pretrained(d)
    for scheme in ("int8", "int4-g8"):
        _, loaded = sbd_jax.from_pretrained(d, quantize=scheme)
        after = quantize_params(full, cfg, scheme)
        assert jax.tree.structure(loaded) == jax.tree.structure(after)
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(after)):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a).astype(np.float32),
                                                         np.asarray(b).astype(np.float32))
    from sbd_jax.decoding.sampler import Sampler
    s = Sampler.load(d, quantize="fp8")
    assert all(isinstance(lp[n], QArray) and lp[n].qvalue.dtype == ml_dtypes.float8_e4m3fn
               for lp in s.params["layers"] for n in QUANTIZED)


def test_errors_name_the_option_or_weight(params, quantized):
    for bad, msg in (("int5", "quantize='int5' is not a known scheme (choose from int8, fp8, int4)"),
                     ("int8-g32", "group_size=32 is for int4 only"),
                     ("int4-gx", "write the int4 group size as int4-g<N>"),
                     (7, "must be a scheme name")):
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            Quantization.of(bad)
    with pytest.raises(ConfigError, match=r"int4 group size 32 does not divide layers.wo's input dim of 8 .*"
                                          r"quantize='int4-g8'"):
        quantize_params(params, CFG, "int4")
    with pytest.raises(ConfigError, match=r"layers.wq is already quantized \(QArray\)"):
        quantize_params(quantized["int8"], CFG, "int8")
    with pytest.raises(DecodeError, match=r"kv_cache_dtype must be None \(the compute dtype\) or one of \('int8',\)"):
        DecodeSpec(kv_cache_dtype="int4")


def _rewrite(d, drop=(), config=None):
    """The checkpoint in `d` with tensors `drop` left out and config.json's quantization_config replaced."""
    import json

    from safetensors.numpy import save_file
    from sbd_jax.io.hf_quant import read_tensor
    f = d / "model.safetensors"
    header = json.loads(f.read_bytes()[8:8 + int.from_bytes(f.read_bytes()[:8], "little")])
    kept = {k: v for k, v in header.items() if k != "__metadata__" and k not in drop}
    tensors = {k: read_tensor(f, k, tuple(v["shape"]), v["dtype"]) for k, v in kept.items()}
    save_file(tensors, str(f))  # (int8 / uint8 / float32: what an int4 checkpoint holds)
    if config is not None:
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, "quantization_config": config}))


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4-g8"])
def test_a_quantized_checkpoint_saves_and_loads_as_it_is(quantized, tmp_path, scheme):
    """save_pretrained writes the values and scales (never full precision: the files are about a quarter / an eighth
    of float32's), config.json names the scheme, from_pretrained reads the same arrays back; quantize= on it is
    refused."""
    qp = quantized[scheme]
    d = sbd_jax.save_pretrained(CFG, qp, tmp_path / scheme)
    cfg, back = sbd_jax.from_pretrained(d)
    assert jax.tree.structure(back) == jax.tree.structure(qp) and quantization_of(back) == Quantization.of(scheme)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(qp)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))
    w = (d / "model.safetensors").read_bytes()
    assert b'"model.layers.1.mlp.down_proj.weight_scale"' in w
    assert b'"dtype":"%s"' % {"int8": b"I8", "fp8": b"F8_E4M3", "int4-g8": b"U8"}[scheme] in w
    with pytest.raises(ConfigError, match=r"is already quantized \(%s\): load it without quantize=" % scheme):
        sbd_jax.from_pretrained(d, quantize="int8")
    c = json.loads((d / "config.json").read_text())  # its scheme lost: the values are never read as weights
    (d / "config.json").write_text(json.dumps({k: v for k, v in c.items() if k != "quantization_config"}))
    with pytest.raises(CheckpointError, match=r"weight 'model.layers.0.[a-z_.]+_proj.weight' in .* is stored as "
                       r"%s, not a float type: a quantized checkpoint whose config.json lacks quantization_config"
                       % {"int8": "I8", "fp8": "F8_E4M3", "int4-g8": "U8"}[scheme]):
        sbd_jax.from_pretrained(d)


def test_a_damaged_quantized_checkpoint_is_refused_by_name(quantized, tmp_path):
    from sbd_jax.io.hf_layout import CheckpointError
    base = sbd_jax.save_pretrained(CFG, quantized["int4-g8"], tmp_path / "m")
    cases = [(dict(drop=("model.layers.0.self_attn.o_proj.weight_low",)),
              r"'model.layers.0.self_attn.o_proj.weight_low' is missing from the quantized checkpoint \(int4-g8"),
             (dict(config={"quant_method": "sbd_jax", "scheme": "int4", "group_size": 4}),
              r"model.safetensors': 'model.layers.0.mlp.down_proj.weight_scale' is F16 \[32, 8\], expected F16 "
              r"\[32, 16\]"),
             (dict(config={"quant_method": "sbd_jax", "scheme": "int8", "group_size": None}),
              r"'model.layers.0.mlp.down_proj.weight' is U8 \[32, 32\], expected I8 \[32, 64\]"),
             (dict(config={"quant_method": "gptq", "bits": 4}), "quant_method 'gptq'"),
             (dict(config={"quant_method": "sbd_jax", "scheme": "int3"}), "quantize='int3' is not a known scheme")]
    for i, (how, msg) in enumerate(cases):
        d = tmp_path / f"bad{i}"
        d.mkdir()
        for f in base.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        _rewrite(d, **how)
        with pytest.raises(CheckpointError, match=msg):
            sbd_jax.from_pretrained(d)


def test_a_quantized_checkpoint_is_not_fine_tuned(quantized, tmp_path):
    """train.py's model.init_from on a quantized (decoding) checkpoint: refused by name before anything loads."""
    from sbd_jax.training.config import ModelSource
    from sbd_jax.training.model_source import prepare_model
    d = sbd_jax.save_pretrained(CFG, quantized["int8"], tmp_path / "q")
    with pytest.raises(ConfigError, match=r"model.init_from=.* holds int8-quantized weights \(a decoding checkpoint\)"):
        prepare_model(ModelSource(config=None, init_from=str(d)), 0, None)


def _obq_reference(W: np.ndarray, H: np.ndarray, scale: np.ndarray, grid) -> np.ndarray:
    """GPTQ's column order, the straightforward way (not the library's lazy-batch / Cholesky form): quantize input
    column i, spread its error over the columns left with the inverse Hessian of those columns, then drop i from it
    (Gaussian elimination of H^-1)."""
    W = W.copy()
    H = H + 0.01 * np.mean(np.diag(H)) * np.eye(len(H))
    Hinv = np.linalg.inv(H)
    G = np.zeros_like(W)
    for i in range(W.shape[1]):
        G[:, i] = grid(W[:, i] / scale)
        err = (W[:, i] - G[:, i] * scale) / Hinv[i, i]
        W[:, i + 1:] -= np.outer(err, Hinv[i, i + 1:])
        Hinv = Hinv - np.outer(Hinv[:, i], Hinv[i, :]) / Hinv[i, i]
    return G


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_gptq_equals_its_reference_and_beats_rounding_on_the_calibration(params, quantized, scheme):
    """gptq_params: the same scales and layout as round-to-nearest, values equal to a float64 reference of GPTQ's
    updates (exact grid values), and a smaller output error on the calibration activations."""
    from sbd_jax.models.gptq import calibration_hessians, gptq_params
    from sbd_jax.models.params import unstack_layers
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 24))
    got = gptq_params(params, CFG, scheme, ids)
    rtn = quantized[scheme]
    H = calibration_hessians(unstack_layers(params), CFG, ids)
    grid = {"int8": lambda x: np.clip(np.round(x), -128, 127),
            "fp8": lambda x: np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)}[scheme]
    for name in QUANTIZED:
        g, r = got["layers"][name], rtn["layers"][name]
        assert isinstance(g, QArray) and g.qvalue.dtype == r.qvalue.dtype and np.array_equal(g.scale, r.scale)
        for li in range(CFG.num_hidden_layers):
            ins, outs = weight_axes(name, params["layers"][name].ndim - 1)
            w = np.transpose(np.asarray(params["layers"][name][li], np.float64), outs + ins)
            W = w.reshape(int(np.prod(w.shape[:len(outs)])), -1)
            scale = np.transpose(np.asarray(r.scale[li], np.float64), outs + ins).reshape(-1)
            ref = _obq_reference(W, H[(li, name)], scale, grid)
            mine = np.transpose(np.asarray(g.qvalue[li]).astype(np.float64), outs + ins).reshape(ref.shape)
            assert np.array_equal(mine, ref), (name, li)
            rq = np.transpose(np.asarray(r.qvalue[li]).astype(np.float64), outs + ins).reshape(ref.shape)
            err = lambda G: np.trace((W - G * scale[:, None]) @ H[(li, name)] @ (W - G * scale[:, None]).T)  # noqa: E731
            assert err(mine) < err(rq), (name, li)
    with pytest.raises(ConfigError, match="GPTQ calibration is for int8 and fp8"):
        gptq_params(params, CFG, "int4-g8", ids)


def test_quantize_cli_saves_the_gptq_model(params, tmp_path, capsys):
    """python -m sbd_jax.io.quantize DIR OUT --quantize fp8 --calibration text.jsonl: OUT loads quantized with GPTQ's
    values (not round-to-nearest's) on the same scales; too little calibration text is an error line."""
    from sbd_jax.io import quantize as cli
    from sbd_jax.io.tokenizer import Tokenizer
    src = sbd_jax.save_pretrained(CFG, params, tmp_path / "m")
    words = [f"w{i}" for i in range(CFG.vocab_size - 1)]
    from tokenizers import Tokenizer as HF
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    hf = HF(WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    hf.pre_tokenizer = WhitespaceSplit()
    hf.save(str(src / "tokenizer.json"))
    rng = np.random.default_rng(1)
    text = tmp_path / "cal.jsonl"
    text.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 40))}) + "\n" for _ in range(4)))
    assert cli.main([str(src), str(tmp_path / "q"), "--quantize", "fp8", "--calibration", str(text),
                     "--windows", "4", "--tokens", "32"]) == 0
    cfg, got = sbd_jax.from_pretrained(tmp_path / "q")
    assert cli.calibration_windows(text, Tokenizer.load(src), 4, 32).shape == (4, 32)
    (tmp_path / "bin.jsonl").write_bytes(b'{"text": "w1 w2"}\n\x89PNG\r\n\x1a\n\xff\x00')
    with pytest.raises(ConfigError, match=r"bin\.jsonl' line 2 is not UTF-8 text \(byte 0\)"):
        cli.calibration_windows(tmp_path / "bin.jsonl", Tokenizer.load(src), 4, 32)
    huge = tmp_path / "huge.jsonl"  # one 20 MB line: only the prefix the windows need is tokenized
    line = " ".join(rng.choice(words, 5_000_000))
    huge.write_text(json.dumps({"text": line}) + "\n")
    tok, seen = Tokenizer.load(src), []
    encode = tok.encode
    tok.encode = lambda t, **kw: seen.append(len(t)) or encode(t, **kw)
    got_ids = cli.calibration_windows(huge, tok, 4, 32)
    assert got_ids.ravel().tolist() == encode(line[:10_000], add_special_tokens=False)[:128] and max(seen) < 10_000
    rtn = quantize_params(params, CFG, "fp8")  # GPTQ's values (checked above) on round-to-nearest's scales
    for name in QUANTIZED:
        g, r = got["layers"][name], rtn["layers"][name]
        assert np.array_equal(g.scale, r.scale) and not np.array_equal(np.asarray(g.qvalue, np.float32),
                                                                       np.asarray(r.qvalue, np.float32)), name
    assert (tmp_path / "q" / "tokenizer.json").is_file()
    assert cli.main([str(src), str(tmp_path / "q2"), "--quantize", "fp8", "--calibration", str(text),
                     "--windows", "100"]) == 2
    assert "holds 160 tokens; 100 windows of 512 need 51200" in capsys.readouterr().err


def test_quantize_onto_a_full_disk_leaves_nothing_and_reruns(params, tmp_path, capsys, monkeypatch):
    """A write that fails part way (ENOSPC after the first file) is one error line; the output directory does not
    exist afterwards (no empty or partial one blocks the rerun), and the rerun writes it."""
    import errno

    from sbd_jax.io import quantize as cli
    from sbd_jax.models.quant import quantization_of
    src = sbd_jax.save_pretrained(CFG, params, tmp_path / "m")
    save = cli.save_pretrained

    def full_disk(cfg, p, out):
        save(cfg, p, out)  # the files land, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(cli, "save_pretrained", full_disk)
    assert cli.main([str(src), str(tmp_path / "q"), "--quantize", "int8"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "q'" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    monkeypatch.setattr(cli, "save_pretrained", save)
    assert cli.main([str(src), str(tmp_path / "q"), "--quantize", "int8"]) == 0
    assert quantization_of(sbd_jax.from_pretrained(tmp_path / "q")[1]) is not None
