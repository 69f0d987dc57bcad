"""The draft recipe (docs/training.md, "Drafts in hours"): copy-only LoRA adapters (lora.copy_only) act on
copy-stream tokens only, so the clean stream is the base model bit for bit, the training step runs the clean half
without a backward pass, and lossless decoding returns the base model's own AR output; the one-forward draft metric;
self-distilled data."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from training_fixtures import CFG, np_params, packed_batch

from sbd_jax.attention import clean_meta, concat_meta, copy_meta
from sbd_jax.config import ConfigError
from sbd_jax.decoding import generate
from sbd_jax.io.peft import apply_adapter, save_adapter
from sbd_jax.models import forward
from sbd_jax.models.lora import LORA_TARGETS, AdapterLayout, attach, init_adapter, merge
from sbd_jax.models.transformer import init_cache
from sbd_jax.training.examples import build_sbd_example, sample_masked
from sbd_jax.training.loss import loss_sums
from sbd_jax.training.model_source import add_mask_row
from sbd_jax.training.spec import ExampleSpec


def _model(tied=True, seed=1, std=0.3):
    """A base with the mask row added (weights std 0.3: sharp logits, varied greedy tokens), a copy-only adapter as
    after training (noise on every array)."""
    cfg, base = add_mask_row(dataclasses.replace(CFG, tie_word_embeddings=tied, mask_token_id=None),
                             np_params(dataclasses.replace(CFG, tie_word_embeddings=tied), std=0.3))
    layout = AdapterLayout(4, 8.0, tuple(LORA_TARGETS), mask_row=cfg.mask_token_id, copy_only=True)
    ad = init_adapter(cfg, layout, jax.random.key(seed), base)
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(ad))))
    ad = jax.tree.map(lambda a: a + std * jax.random.normal(next(keys), a.shape, a.dtype), ad)
    return cfg, base, layout, ad


def _sbd_sequence(cfg, L=12, k=4, B=2):
    rng = np.random.default_rng(0)
    x = rng.integers(4, cfg.vocab_size - 1, (B, L)).astype(np.int32)
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    masked = np.where(rng.random((B, L)) < 0.6, cfg.mask_token_id, x)
    seg = np.ones((B, L), np.int32)
    meta = concat_meta(clean_meta(seg, pos), copy_meta(seg, pos, (pos // k) * k))
    return np.concatenate([x, masked], 1), meta


@pytest.mark.parametrize("tied", [True, False])
def test_clean_stream_is_the_base_bit_for_bit(tied):
    """[x ; x_hat] with a copy-only adapter: the clean half's logits equal the base's exactly (also in a decoding
    call over the cache), the copy half's differ; the adapter has no lm_head row of its own and is not mergeable."""
    cfg, base, layout, ad = _model(tied)
    tokens, meta = _sbd_sequence(cfg)
    L = tokens.shape[1] // 2
    ours = np.asarray(forward(attach(base, ad, layout), cfg, tokens, meta)[0])
    plain = np.asarray(forward(base, cfg, tokens, meta)[0])
    np.testing.assert_array_equal(ours[:, :L], plain[:, :L])
    assert np.abs(ours[:, L:] - plain[:, L:]).max() > 0.1
    assert "mask_head" not in ad
    with pytest.raises(ConfigError, match="copy-only"):
        merge(base, ad, layout)
    # a decoding call: 6 clean tokens into the cache, then [2 clean ; 4 copy] over it
    cache = init_cache(cfg, 2, 16)
    params = attach(base, ad, layout)
    _, cache = forward(params, cfg, tokens[:, :6], meta.take((slice(None), slice(0, 6))), cache)
    _, cache_b = forward(base, cfg, tokens[:, :6], meta.take((slice(None), slice(0, 6))), init_cache(cfg, 2, 16))
    np.testing.assert_array_equal(np.asarray(cache.k), np.asarray(cache_b.k))
    sel = np.r_[6:8, L + 8:L + 12]
    win, wmeta = tokens[:, sel], meta.take((slice(None), sel))
    got = np.asarray(forward(params, cfg, win, wmeta, cache)[0])
    ref = np.asarray(forward(base, cfg, win, wmeta, cache_b)[0])
    np.testing.assert_array_equal(got[:, :2], ref[:, :2])
    assert np.abs(got[:, 2:] - ref[:, 2:]).max() > 0.1


def test_frozen_clean_half_gives_the_gated_forwards_loss_and_gradient():
    """The training layout's fast path (clean half without adapter and backward, `clean_prefix`; and the CE on the
    copy half only, `copy_only`) == the plain gated forward over the whole row: the same MATP loss and the same
    adapter gradient (float32, 1e-5)."""
    cfg, base, layout, ad = _model()
    batch = jax.tree.map(jnp.asarray, packed_batch())
    spec = ExampleSpec(mask_token_id=cfg.mask_token_id, position_decay=0.8)
    ex = build_sbd_example(batch, sample_masked(jax.random.key(0), batch, (0.5, 1.0)), jnp.int32(4), spec)
    ex = ex._replace(ntp_weight=jnp.zeros_like(ex.ntp_weight))
    L = batch.tokens.shape[1]

    def loss(a, prefix, copy_only=False):
        s = loss_sums(attach(base, a, layout), cfg, ex, chunk=0, clean_prefix=prefix, copy_only=copy_only)
        return s.matp_sum / s.matp_count
    (fast, g_fast), (slow, g_slow) = (jax.value_and_grad(loss)(ad, p) for p in (L, None))
    np.testing.assert_allclose(fast, slow, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), g_fast, g_slow)
    assert min(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_fast)) > 0  # every array gets a gradient
    copy, g_copy = jax.value_and_grad(loss)(ad, L, True)  # the lm_head and CE on the copy half only: the same
    np.testing.assert_allclose(copy, slow, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), g_copy, g_slow)


def test_position_weights_decay_by_block_offset_and_scale_offset_0():
    """MATP weights of an all-masked copy stream: decay^j at block offset j (offset 0: 1), times offset0_weight
    at offset 0 only; the blocks of 4 start at each document's response."""
    cfg, *_ = _model()
    batch = jax.tree.map(jnp.asarray, packed_batch())
    L = batch.tokens.shape[1]
    masked = sample_masked(jax.random.key(0), batch, (1.0, 1.0))
    w = {w0: np.asarray(build_sbd_example(batch, masked, jnp.int32(4), ExampleSpec(
        mask_token_id=cfg.mask_token_id, position_decay=0.8, block_align="response", offset0_weight=w0)).matp_weight)[:, L:]
        for w0 in (1.0, 0.25, 0.0)}
    first = w[1.0] == 1.0  # offset 0: decay^0
    assert first.sum() > 1
    np.testing.assert_allclose(np.unique(w[1.0][w[1.0] > 0]), [0.512, 0.64, 0.8, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(w[0.25], np.where(first, 0.25, w[1.0]))
    np.testing.assert_array_equal(w[0.0], np.where(first, 0.0, w[1.0]))


def test_soft_targets_are_the_clean_streams_distribution_in_float64():
    """sbd.soft_targets = s: each masked copy token's CE is against (1 - s) x its token + s x the clean stream's
    softmax at the clean position before it (the base's next-token distribution there), each from the whole-row
    forward in float64 numpy (tolerance 1e-5 relative); the adapter's gradient ignores the teacher (no gradient
    flows into it) and s = 0 is the plain loss."""
    cfg, base, layout, ad = _model()
    batch = jax.tree.map(jnp.asarray, packed_batch())
    L = batch.tokens.shape[1]
    spec = ExampleSpec(mask_token_id=cfg.mask_token_id, position_decay=0.8, block_align="response", copy_len=L // 2)
    ex = build_sbd_example(batch, sample_masked(jax.random.key(0), batch, (1.0, 1.0)), jnp.int32(4), spec)
    ex = ex._replace(ntp_weight=jnp.zeros_like(ex.ntp_weight))

    def loss(a, soft, chunk=0):
        s = loss_sums(attach(base, a, layout), cfg, ex, chunk=chunk, clean_prefix=L, copy_only=True,
                      soft_targets=soft)
        return s.matp_sum / s.matp_count
    logits = np.asarray(forward(attach(base, ad, layout), cfg, ex.tokens, ex.meta)[0], np.float64)
    lse = lambda z: np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)  # noqa: E731
    w, tgt, teach = (np.asarray(a)[:, L:] for a in (ex.matp_weight, ex.targets, ex.teacher))
    student = logits[:, L:]
    p = np.exp(logits[:, :L] - lse(logits[:, :L])[..., None])
    p = np.take_along_axis(p, np.maximum(teach, 0)[..., None], axis=1)
    # a copy token's teacher is the clean position just before its target's (the clean token after it is the
    # target), none (-1) at a document's first token: there the target stays the token
    has = (teach >= 0) & (w > 0)
    assert has.sum() > 0 and np.all(np.take_along_axis(np.asarray(ex.tokens)[:, :L], teach + 1, 1)[has] == tgt[has])
    c_pos = np.asarray(ex.meta.position)[:, L:]
    assert np.array_equal(teach[w > 0] < 0, c_pos[w > 0] == 0) and np.any(teach[w > 0] < 0)
    for soft in (0.0, 0.5, 1.0):
        s_t = soft * has
        mix = (1 - s_t) * np.take_along_axis(student, tgt[..., None], -1)[..., 0] + s_t * (p * student).sum(-1)
        ref = ((lse(student) - mix) * w).sum() / w.sum()
        np.testing.assert_allclose(float(loss(ad, soft)), ref, rtol=1e-5)
    np.testing.assert_allclose(float(loss(ad, 0.5, chunk=4)), float(loss(ad, 0.5)), rtol=1e-6)  # in loss chunks
    g0, g1 = (jax.grad(loss)(ad, soft) for soft in (0.0, 1.0))
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1))) > 1e-4
    with pytest.raises(ValueError, match="copy-only"):
        loss_sums(attach(base, ad, layout), cfg, ex, chunk=0, clean_prefix=L, soft_targets=0.5)


def test_lossless_output_is_the_base_models_ar(tmp_path):
    """Saved and loaded again (sbd_adapter.json says copy_only; attached, not merged), the adapter decodes in verify
    mode exactly the base model's AR tokens."""
    cfg, base, layout, ad = _model()
    base0 = {**base, "embed": base["embed"][:-1]}
    cfg0 = dataclasses.replace(cfg, vocab_size=cfg.vocab_size - 1, mask_token_id=None)
    out = save_adapter(tmp_path / "ad", cfg, layout, ad, fingerprint=None)
    cfg2, params = apply_adapter(cfg0, base0, out)
    assert cfg2.mask_token_id == cfg.mask_token_id
    rng = np.random.default_rng(3)
    prompts = rng.integers(4, cfg0.vocab_size, (3, 7)).astype(np.int32)
    lengths = np.array([7, 5, 3], np.int32)
    ar = generate(base, cfg, prompts, lengths, mode="ar", max_new_tokens=24, eos_ids=())
    ver = generate(params, cfg2, prompts, lengths, mode="sbd", verify=True, draft_policy="always", block_size=4,
                   max_new_tokens=24, eos_ids=())
    np.testing.assert_array_equal(np.asarray(ver.tokens), np.asarray(ar.tokens))
    assert len(set(np.asarray(ar.tokens).ravel().tolist())) > 5  # a real sequence, not one repeated token


def test_draft_quality_equals_a_per_block_brute_force(tmp_path):
    """The one-forward metric == a forward per block (prefix clean, the block's k masks as copy queries, nothing
    else): the same drafts, so the same agreement per offset, accepted prefix and histogram; for a copy-only
    adapter on the base that wrote the continuations, AR agreement is 1."""
    from sbd_jax.training.draft_quality import block_drafts, chain_calls, draft_quality, load_draft_set, score
    cfg, base, layout, ad = _model(std=0.1)
    params = attach(base, ad, layout)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(4, cfg.vocab_size - 1, n).tolist() for n in (9, 5, 7)]
    lens = np.array([len(p) for p in prompts] + [0] * 0, np.int32)
    P = max(lens)
    padded = np.array([p + [0] * (P - len(p)) for p in prompts], np.int32)
    cont = np.asarray(generate(base, cfg, padded, lens, mode="ar", max_new_tokens=14, eos_ids=()).tokens)
    path = tmp_path / "held.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p, "response_ids": c[:n].tolist()}) + "\n"
                            for p, c, n in zip(prompts, cont, (14, 12, 9))))
    k = 4
    ds = load_draft_set(path, rows=8, prompt_len=9, cont_len=13)
    got = draft_quality(params, cfg, ds, k)
    drafts = np.zeros(ds.tokens.shape, np.int32)
    for r in range(3):
        p, c = int(ds.prompt_lengths[r]), int(ds.cont_lengths[r])
        for b in range(0, c - k + 1, k):
            clean = ds.tokens[r, :p + b]
            toks = np.concatenate([clean, np.full(k, cfg.mask_token_id)])[None].astype(np.int32)
            pos = np.r_[np.arange(p + b), p + b + np.arange(k)][None]
            meta = concat_meta(clean_meta(np.ones((1, p + b)), pos[:, :p + b]),
                               copy_meta(np.ones((1, k)), pos[:, p + b:], np.full((1, k), p + b)))
            logits = np.array(forward(params, cfg, toks, meta)[0])[0, p + b:]
            logits[:, cfg.mask_token_id] = -np.inf
            drafts[r, p + b:p + b + k] = logits.argmax(-1)
    ref = score(ds, drafts, ds.tokens, k)  # AR tokens = the continuations themselves (the base wrote them)
    np.testing.assert_array_equal(got.agreement, ref.agreement)
    assert (got.accepted, got.blocks, got.accepted_hist.tolist()) == (ref.accepted, ref.blocks,
                                                                      ref.accepted_hist.tolist())
    assert got.blocks == 3 + 3 + 2 and got.ar_agreement == 1.0
    assert 0 < got.agreement.mean() < 1  # neither trivially right nor wrong: the comparison means something
    # the chain of blocks replayed from every alignment's drafts takes exactly the calls verify mode takes
    chained = chain_calls(ds, [block_drafts(params, cfg, ds, k, r)[0] for r in range(k)], k)
    ids = np.stack([np.pad(ds.tokens[r, :p], (0, P - p)) for r, p in enumerate(ds.prompt_lengths)])
    ver = generate(params, cfg, ids, ds.prompt_lengths, mode="sbd", verify=True, draft_policy="always", block_size=k,
                   max_new_tokens=13, row_max_new_tokens=ds.cont_lengths, eos_ids=())
    np.testing.assert_array_equal(np.asarray(ver.nfe), chained)
    assert chained.sum() < ds.cont_lengths.sum()  # some drafts stood


def test_self_distillation_to_a_copy_only_adapter_end_to_end(tmp_path):
    """decode.py --mode ar writes a base's greedy continuations; distill.join pairs them with their prompts (the ids
    are the decoder's AR output, token for token); train.py trains a copy-only adapter on them (ids read as they are,
    no NTP term, the draft metric logged with AR agreement 1); decode.py --adapter --verify then returns exactly the
    base's AR tokens (trained with soft targets: the jitted step's path for them)."""
    import decode
    from sbd_jax.io.hf import from_pretrained
    from sbd_jax.training.distill import join
    from test_lora import _model_dir, _train_py
    from training_fixtures import write_inputs
    cfg_path = write_inputs(tmp_path)
    base = _model_dir(tmp_path / "base", 0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 60, n).tolist() for n in (5, 9, 7, 8, 6, 9)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": p}) + "\n"
                                                    for i, p in enumerate(prompts)))
    greedy = tmp_path / "greedy.jsonl"
    assert decode.main(["--model", str(base), "--input", str(tmp_path / "prompts.jsonl"), "--output", str(greedy),
                        "--mode", "ar", "--max-new-tokens", "12", "--no-progress", "--ignore-eos"]) == 0
    assert join(tmp_path / "prompts.jsonl", greedy, tmp_path / "distilled.jsonl") == 6
    records = [json.loads(ln) for ln in (tmp_path / "distilled.jsonl").read_text().splitlines()]
    cfg, params = from_pretrained(base)
    lengths = np.array([len(p) for p in prompts], np.int32)
    padded = np.array([p + [0] * (9 - len(p)) for p in prompts], np.int32)
    ar = np.asarray(generate(params, cfg, padded, lengths, mode="ar", max_new_tokens=12, eos_ids=()).tokens)
    assert [r["prompt_ids"] for r in records] == prompts
    assert [r["response_ids"] for r in records] == ar.tolist()
    run = tmp_path / "run"
    over = ["model.config=null", f"model.init_from={base}", "model.add_mask_token=true", "lora.rank=4",
            "lora.copy_only=true", "sbd.eta=[1.0, 1.0]", "sbd.position_decay=0.8", "sbd.block_align=response",
            "sbd.soft_targets=0.5", f"data.path={tmp_path / 'distilled.jsonl'}", "data.prompt_field=prompt_ids",
            "data.response_field=response_ids", "data.seq_len=24", f"draft_eval.path={tmp_path / 'distilled.jsonl'}",
            "draft_eval.every=2", "draft_eval.block_size=4", "draft_eval.prompt_len=9", "draft_eval.cont_len=12",
            "steps=4", "checkpoint.every=2", f"out_dir={run}"]
    assert _train_py(["--config", str(cfg_path), *over]) == 0
    evals = [json.loads(ln) for ln in (run / "draft_quality.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4] and all(e["ar_agreement"] == 1.0 and e["blocks"] == 18 for e in evals)
    assert evals[1]["seconds"] > evals[0]["seconds"] > 0 and evals[1]["cpu_seconds"] > evals[0]["cpu_seconds"] > 0
    hist = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(h["ntp_loss"] == 0.0 and h["matp_loss"] > 0 for h in hist)
    assert json.loads((run / "adapter" / "sbd_adapter.json").read_text())["copy_only"] is True
    out = tmp_path / "verify.jsonl"
    assert decode.main(["--model", str(base), "--adapter", str(run / "adapter"), "--input",
                        str(tmp_path / "prompts.jsonl"), "--output", str(out), "--verify", "--draft-policy", "always",
                        "--block-size", "4", "--max-new-tokens", "12", "--no-progress", "--ignore-eos"]) == 0
    assert [json.loads(ln)["tokens"] for ln in out.read_text().splitlines()] == ar.tolist()
    # with int8 weights (the base under each LoRA path quantized): the quantized base's AR tokens
    for name, extra in (("q_ar", ["--mode", "ar"]), ("q_verify", ["--adapter", str(run / "adapter"), "--verify"])):
        assert decode.main(["--model", str(base), "--input", str(tmp_path / "prompts.jsonl"), "--output",
                            str(tmp_path / f"{name}.jsonl"), "--quantize", "int8", "--block-size", "4",
                            "--max-new-tokens", "12", "--no-progress", "--ignore-eos", *extra]) == 0
    q_ar, q_verify = ([json.loads(ln)["tokens"] for ln in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
                      for n in ("q_ar", "q_verify"))
    assert q_verify == q_ar


def test_recipe_options_are_checked_by_name():
    from sbd_jax.config import load_config  # noqa: F401  (the YAML path goes through the same dataclasses)
    from sbd_jax.training.config import LoRAConfig, TrainConfig
    from sbd_jax.training.spec import SBDConfig
    from sbd_jax.training.config import DraftEvalConfig, ModelSource
    for bad, key in (({"eta": (0.5, 0.2)}, "sbd.eta"), ({"eta": (0.0, 1.5)}, "sbd.eta"),
                     ({"position_decay": 0.0}, "sbd.position_decay"), ({"position_decay": 1.5}, "sbd.position_decay"),
                     ({"offset0_weight": -0.5}, "sbd.offset0_weight")):
        with pytest.raises(ConfigError, match=key):
            SBDConfig(**bad)
    with pytest.raises(ConfigError, match="export_merged"):
        LoRAConfig(copy_only=True, export_merged=True)
    with pytest.raises(ConfigError, match="ntp_only"):
        TrainConfig(model=ModelSource(config=CFG), lora=LoRAConfig(copy_only=True), sbd=SBDConfig(ntp_only=True))
    with pytest.raises(ConfigError, match="sbd.soft_targets"):
        SBDConfig(soft_targets=1.5)
    for lora in (None, LoRAConfig()):  # the clean stream is the teacher only when it is the frozen base's
        with pytest.raises(ConfigError, match="soft_targets.*copy_only"):
            TrainConfig(model=ModelSource(config=CFG), lora=lora, sbd=SBDConfig(soft_targets=0.5))
    with pytest.raises(ConfigError, match="draft_eval.block_size"):
        DraftEvalConfig(block_size=40, cont_len=32)
    with pytest.raises(ConfigError, match="model.mask_init.*'ones'"):
        ModelSource(config=CFG, add_mask_token=True, mask_init="ones")


@pytest.mark.parametrize("tied", [True, False])
def test_mask_row_inits(tied):
    """The `<m>` row (embedding row and untied lm_head column) as model.mask_init builds it; the rows before it kept."""
    cfg0 = dataclasses.replace(CFG, tie_word_embeddings=tied, mask_token_id=None)
    base = np_params(dataclasses.replace(CFG, tie_word_embeddings=tied), std=0.3)
    rows = {init: add_mask_row(cfg0, base, init, seed=3)[1] for init in ("mean", "zero", "random")}
    for name, axis in (("embed", 0), ("lm_head", 1)) if not tied else (("embed", 0),):
        w = np.asarray(base[name], np.float64)
        new = {k: np.take(np.asarray(p[name], np.float64), [-1], axis=axis) for k, p in rows.items()}
        for p in rows.values():
            np.testing.assert_array_equal(np.take(np.asarray(p[name]), np.arange(w.shape[axis]), axis=axis), w)
        np.testing.assert_allclose(new["mean"], w.mean(axis=axis, keepdims=True), atol=1e-6)
        assert not new["zero"].any()
        assert 0.7 < new["random"].std() / w.std() < 1.3 and abs(new["random"].mean()) < 0.5 * w.std()
        again = add_mask_row(cfg0, base, "random", seed=3)[1][name]
        np.testing.assert_array_equal(np.asarray(again), np.asarray(rows["random"][name]))  # seeded
        other = np.take(np.asarray(add_mask_row(cfg0, base, "random", seed=4)[1][name]), [-1], axis=axis)
        assert np.abs(other - new["random"]).max() > 0.01
