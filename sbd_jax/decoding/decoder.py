"""`generate`: jitted SBD / verify / AR decoding over a static KV cache, one `lax.while_loop` (loop.py), nothing
returns to the host per step (docs/sbd.md, "Inference"; the options are a `DecodeSpec`; the modes in modes/, the loop
state in state.py, the prompt prefill in prefill.py, the request checks in checks.py).

  * Prompts arrive right-padded: `prompt_ids [B, P]`, `prompt_lengths [B]`. Row b's prompt occupies
    positions (= cache slots) [0, len_b); its generated token j sits at position len_b + j. Rows never
    see each other or their padding (segment 0). The cache holds S = P + max_new_tokens slots; a
    token buffer `seq [B, S + block_size]` holds every token by position (room for a whole last block).
  * Blocks start right after each row's prompt (explicit block starts in the metadata, docs/sbd.md, Inference step 8);
    the last block's positions beyond max_new_tokens are padding.
  * NFE 1 (SBD) = [prompt CLEAN ; first block COPY]: the prefill is folded into the first step. Each
    later step is one call on one of two window shapes chosen by `lax.cond`: once a quorum of the live
    rows (`spec.commit_quorum`) has just finished a block, [finished block CLEAN ; current block COPY]
    writes the finished blocks' exact causal K/V (paper Algorithm 3, no extra forward); otherwise
    [current block COPY], which rows waiting for a commit sit out (their tokens and NFE do not change).
    A copy token carries its token once accepted, the mask token while masked; SBD never samples `<m>`.
  * AR: the prefill call yields the first token, then one clean 1-token call per token (NTP logits).
  * Stop (docs/sbd.md, Inference step 7): an EOS decoded with every earlier position of its block decoded, or
    max_new_tokens. Tokens after the EOS are dropped (the pad id fills the output beyond `lengths`).
    Finished rows become padding: their state, cache and NFE stop changing; NFE counts the calls that
    carry a token of the row. The loop ends when every row is done.
  * Randomness: in SBD mode row b draws its step-n tokens from fold_in(key_b, n); AR and verify mode draw the
    token at generated index j from fold_in(key_b, j), so the two share it (sampling.py).
  * Sharding: with `mesh`, the cache is constrained to `cache_sharding` and per-row state to
    `batch_sharding`; params come laid out by `shard_params`. The loop traces under
    `mesh_context(mesh)`, so attention_impl="pallas" runs per shard (sbd_jax/attention/sharded.py).
  * The window scheme leaves the last block's (AR: last token's) K/V uncommitted; `finalize_cache`
    writes them with one uncounted call, after which the cache equals one causal forward over
    prompt + output (tested exactly).
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..models.config import ModelConfig
from ..models.transformer import KVCache
from ..sharding import mesh_context
from . import sampling
from .checks import check_request
from .loop import run_loop
from .modes import mode_of
from .spec import DEFAULT_GAMMA, DEFAULT_TEMPERATURE, DecodeSpec
from .state import DecodeEnv, LoopState, gather, make_env, new_state, prompt_seq


class GenerateOutput(NamedTuple):
    """tokens [B, max_new_tokens] (int32, the pad id beyond `lengths`), lengths [B] generated tokens (EOS
    included), nfe [B] model calls, stopped_by_eos [B], iterations (model calls of the batch = loop iterations
    + 1; more than the largest NFE when rows waited for a commit quorum), wide_steps (SBD iterations that used
    the 2k commit window), accepted [B, window + 1]: per row, how many of its model calls decoded 0, 1, ...
    window tokens of the output (SBD: counted when their block ends; verify mode: when the call ends),
    mode_stats: what the mode reports of its own state (verify mode: `VerifyStats` - drafts placed and drafts
    that stood per row, and the policy's `memory` for a later call's `draft_memory`; None in the other modes),
    cache (KVCache or None). A token -1 (sampling.NONFINITE) marks where the model's logits were not finite: the
    host-side entry points (RowResult's) raise a DecodeError for it; a caller of `generate` checks `tokens < 0`."""

    tokens: jax.Array
    lengths: jax.Array
    nfe: jax.Array
    stopped_by_eos: jax.Array
    iterations: jax.Array
    wide_steps: jax.Array
    accepted: jax.Array
    mode_stats: typing.Any = None
    cache: KVCache | None = None

    @property
    def tokens_per_forward(self):
        return self.lengths / jnp.maximum(self.nfe, 1)


def generate(params: dict, cfg: ModelConfig, prompt_ids, prompt_lengths, spec: DecodeSpec | None = None, *,
             gamma=DEFAULT_GAMMA, temperature=DEFAULT_TEMPERATURE, key=None, row_max_new_tokens=None, mesh=None,
             draft_memory=None, **options) -> GenerateOutput:
    """Decode a batch of right-padded prompts with SBD or next-token AR.

    params, cfg: the model (`init_params` / `from_pretrained`); params may be sharded
      (`sbd_jax.sharding.shard_params`): pass `mesh` to lay the cache and per-row state out to match.
      On GPU pass them through `models.unstack_layers` once (the stacked layout is slower to decode).
    prompt_ids [B, P] int, prompt_lengths [B] int (1 <= len <= P, right padding).
    spec: a `DecodeSpec` (static: one compiled decoder per spec and shape); `options` are DecodeSpec
      fields that build one or replace those of `spec` (`generate(..., max_new_tokens=64, mode="ar")`).
    gamma (scalar or [B]): the acceptance threshold of the spec's rule.
    temperature (scalar or [B]; 0 = greedy argmax).
    key: PRNG key (typed or raw), or one per row [B] (then a row's output does not depend on its
      batch). Default key 0. Unused when every temperature is 0.
    row_max_new_tokens [B] int: each row's own cap, <= the spec's `max_new_tokens` (the static cache size).
    draft_memory: verify mode's drafting policy starts from what an earlier call learned (a `DraftMemory`:
      its output's `mode_stats.memory`, the same model: a batch then drafts from its first call as the model's
      drafts earned and keeps its exploration schedule), else from nothing.

    Pure and static-shaped: works eagerly and inside a user's `jax.jit` (then gamma, temperature, keys
    and prompts may be traced; the checks read what is concrete). Values traced by a user's jit are not checked:
    prompt_lengths outside [1, P], row_max_new_tokens above the spec's cap, or mask tokens inside a prompt decode
    garbage there without an error; check them before the jit (`checks.check_request` on concrete values does
    what an eager call does). Ahead of time: `GenerateCall`.
    """
    spec = DecodeSpec.make(spec, **options)
    prompt_ids = jnp.asarray(prompt_ids)
    check_request(cfg, spec, prompt_ids.shape, prompt_lengths=prompt_lengths, prompt_ids=prompt_ids, gamma=gamma,
                  temperature=temperature, row_max_new_tokens=row_max_new_tokens)
    return GenerateCall.build(params, cfg, prompt_ids, prompt_lengths, spec, gamma=gamma, temperature=temperature,
                              key=key, row_max_new_tokens=row_max_new_tokens, mesh=mesh, draft_memory=draft_memory)()


@dataclasses.dataclass(frozen=True)
class GenerateCall:
    """One `generate` call with its arguments normalised and its static part (model config, spec, mesh) apart:
    run it (`call()`), or lower and compile it ahead of time (`call.lower().compile()(*call.args)`). Building one
    checks nothing: `generate` checks its request first, the batch runner checks its prompts once per run."""

    args: tuple
    cfg: ModelConfig
    spec: DecodeSpec
    mesh: object = None

    @classmethod
    def build(cls, params: dict, cfg: ModelConfig, prompt_ids, prompt_lengths, spec: DecodeSpec | None = None, *,
              gamma=DEFAULT_GAMMA, temperature=DEFAULT_TEMPERATURE, key=None, row_max_new_tokens=None, mesh=None,
              draft_memory=None, **options) -> GenerateCall:
        """`generate`'s arguments (the same meaning) as the core's."""
        spec = DecodeSpec.make(spec, **options)
        prompt_ids = jnp.asarray(prompt_ids)
        B = prompt_ids.shape[0]
        keys = sampling.row_keys(jax.random.key(0) if key is None else key, B)
        caps = spec.max_new_tokens if row_max_new_tokens is None else row_max_new_tokens
        args = (params, prompt_ids.astype(jnp.int32), jnp.asarray(prompt_lengths, jnp.int32),
                jnp.broadcast_to(jnp.asarray(gamma, jnp.float32), (B,)),
                jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,)), keys,
                jnp.broadcast_to(jnp.asarray(caps, jnp.int32), (B,)), mode_of(spec).start_from(draft_memory, spec))
        return cls(args, cfg, spec, mesh)

    @property
    def static(self) -> dict:
        return {"cfg": self.cfg, "spec": self.spec, "mesh": self.mesh}

    def __call__(self) -> GenerateOutput:
        return decode_batch(*self.args, **self.static)

    def lower(self):
        return decode_batch.lower(*self.args, **self.static)


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "mesh"))
def decode_batch(params, prompt_ids, lengths, gamma_B, temp_B, keys_B, max_new_B, draft_memory=None, *,
                 cfg: ModelConfig, spec: DecodeSpec, mesh=None) -> GenerateOutput:
    with mesh_context(mesh):  # ambient while tracing: attention_impl="pallas" then runs per shard
        P = prompt_ids.shape[1]
        mode = mode_of(spec)
        env = make_env(params, cfg, spec, lengths, max_new_B, gamma_B, temp_B, keys_B, mesh)
        state = new_state(env, prompt_seq(prompt_ids, lengths, spec, env), P,
                          mode.init_state(env, prompt_ids.shape[0], draft_memory))
        state = mode.first(state, env, prompt_ids)
        state = run_loop(state, env, mode.step)
        cache = mode.finalize(state, env) if spec.finalize_cache else state.cache
        return output(state, env, cache if spec.return_cache else None)


def output(state: LoopState, env: DecodeEnv, cache=None) -> GenerateOutput:
    """The loop's final state as `GenerateOutput` (tokens beyond a row's length are the pad id)."""
    spec = env.spec
    j = jnp.arange(spec.max_new_tokens, dtype=jnp.int32)[None]
    out = jnp.where(j < state.n_generated[:, None], gather(state.seq, env.lengths[:, None] + j), spec.pad(env.cfg))
    return GenerateOutput(tokens=out, lengths=state.n_generated, nfe=state.nfe, stopped_by_eos=state.eos,
                          iterations=state.iters, wide_steps=state.wide, accepted=state.accepted,
                          mode_stats=mode_of(spec).report(state), cache=cache)


