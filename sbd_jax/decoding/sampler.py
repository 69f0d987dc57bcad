"""Text in, text out: load a model directory once, then complete strings or chat conversations (the shape of
google/tunix's `Sampler`). Wraps the batch runner (`decode_prompts`: continuous slots, per-row keys) and the
model directory's tokenizer and stop ids; decode.py is this plus its files."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

from ..models.config import ModelConfig
from ..io.tokenizer import Tokenizer
from ..models.quant import Quantization, quantize_params
from .prompts import Prompt, row_ids
from .results import RowResult, RunSummary
from .runner import DecodeOptions, decode_prompts
from .checks import check_finite_params, check_model
from .spec import DecodeError, DecodeSpec


def generation_eos(cfg: ModelConfig, model_dir) -> tuple[int, ...]:
    """The model's stop ids: config.json's EOS, plus generation_config.json's (where an export lists the chat
    template's end-of-turn token)."""
    ids = list(cfg.eos_ids)
    gc = Path(model_dir) / "generation_config.json"
    if gc.is_file():
        try:
            e = json.loads(gc.read_text()).get("eos_token_id")
        except json.JSONDecodeError as err:
            raise DecodeError(f"cannot read {str(gc)!r}: not valid JSON ({err})") from None
        ids += [e] if isinstance(e, int) else list(e or [])
    return tuple(dict.fromkeys(ids))


def quantized_base(params: dict, cfg: ModelConfig, quantization) -> dict:
    """`params` with the projections quantized; an attached (copy-only) adapter's LoRA weights keep their adapter and
    quantize the base weight under it."""
    from ..models.lora import LoRAWeight, base_of
    q = quantize_params(base_of(params), cfg, quantization, delete=True)
    return jax.tree.map(lambda p, qw: dataclasses.replace(p, w=qw) if isinstance(p, LoRAWeight) else qw, params, q,
                        is_leaf=lambda x: isinstance(x, LoRAWeight))


class Sampler:
    """A loaded model with its tokenizer and stop ids.

        sampler = Sampler.load("/models/my-sbd-export", dtype="bfloat16")
        out = sampler(["Tell me a joke", [{"role": "user", "content": "hi"}]], chat=True, gamma=0.35)
        out[0].text, out[0].stop, out[0].tokens_per_forward
    """

    def __init__(self, params, cfg: ModelConfig, tokenizer: Tokenizer | None, *, eos_ids: Sequence[int] = (),
                 mesh=None):
        self.params, self.cfg, self.tokenizer, self.mesh = params, cfg, tokenizer, mesh
        self.eos_ids = tuple(eos_ids)
        self.draft_memory = None  # verify mode's drafting policy: what it learned in earlier calls

    @classmethod
    def load(cls, model_dir, *, dtype: str | None = None, mesh=None, adapter=None, quantize=None) -> Sampler:
        """Weights in `dtype` (weights and compute; default float32), in `mesh`'s shards when given (each process
        reads its own), tokenizer.json when the directory has one, and the stop ids of config.json and
        generation_config.json. The weights are converted once to the decoding layout (`unstack_layers`).
        `adapter`: a LoRA directory in PEFT's layout (train.py's <out_dir>/adapter) merged into the weights at load,
        refused unless made for this base (sbd_jax/io/peft.py); its tokenizer and stop ids, when it has them, win.
        `quantize`: the projections' weights quantized ("int8", "fp8", "int4[-g<N>]"; sbd_jax/models/quant.py) as
        they load, or, with an adapter, once it is merged."""
        from ..io.hf import from_pretrained
        from ..models import unstack_layers
        quantization = Quantization.of(quantize)
        cfg, params = from_pretrained(model_dir, param_dtype=dtype, dtype=dtype, mesh=mesh,  # no master weights
                                      quantize=None if adapter is not None else quantization)
        eos = generation_eos(cfg, model_dir)
        if adapter is not None:
            from ..io.peft import apply_adapter
            from ..sharding import shard_params
            cfg, params = apply_adapter(cfg, params, adapter, model_dir=model_dir)
            params = params if mesh is None else shard_params(params, cfg, mesh)
            if quantization is not None:
                params = quantized_base(params, cfg, quantization)
            eos = tuple(dict.fromkeys(eos + generation_eos(cfg, adapter)))
        check_finite_params(params, f"model {str(model_dir)!r}" + (f" with adapter {str(adapter)!r}" if adapter else ""))
        tokenizer = (adapter is not None and Tokenizer.find(adapter)) or Tokenizer.find(model_dir)
        return cls(unstack_layers(params, delete=True), cfg, tokenizer, eos_ids=eos, mesh=mesh)

    def options(self, *, spec: DecodeSpec | None = None, **fields) -> DecodeOptions:
        """`DecodeOptions` from `fields`, each a DecodeOptions field (gamma, temperature, seed, batch_size,
        pad_multiple, continuous, compare_ar) or a DecodeSpec field (mode, block_size, rule, verify,
        max_new_tokens, top_k, ...; over `spec` when given), defaults as there; this model's stop ids unless
        `eos_ids` is given. An unknown name is a DecodeError."""
        run_names = {f.name for f in dataclasses.fields(DecodeOptions)} - {"spec"}
        spec_names = {f.name for f in dataclasses.fields(DecodeSpec)}
        unknown = sorted(set(fields) - run_names - spec_names)
        if unknown:
            raise DecodeError(f"unknown decoding option(s) {unknown}; valid: {sorted(run_names)} and DecodeSpec's "
                              f"{sorted(spec_names)}")
        spec = DecodeSpec.make(spec, **{k: v for k, v in fields.items() if k not in run_names})
        if spec.eos_ids is None:
            spec = dataclasses.replace(spec, eos_ids=self.eos_ids)
        opts = DecodeOptions(spec=spec, **{k: v for k, v in fields.items() if k in run_names})
        check_model(self.cfg, opts.spec)
        return opts

    def prompts(self, inputs: Sequence, *, chat: bool = False) -> list[Prompt]:
        """Strings (with `chat`, each as one user message of the chat template), message lists (the template) or
        id lists, as `Prompt`s with ids 0..n-1."""
        if isinstance(inputs, (str, bytes, dict)):
            raise DecodeError(f"inputs must be a list of prompts (strings, message lists or id lists), got "
                              f"{type(inputs).__name__} {str(inputs)[:60]!r}: for one prompt pass [prompt]")
        inputs = list(inputs)
        if not inputs:
            raise DecodeError("inputs is empty: pass at least one prompt")
        out = []
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                row = {"prompt": x}
            elif isinstance(x, (list, tuple)) and x and all(isinstance(m, dict) for m in x):
                row = {"messages": list(x)}
            elif isinstance(x, (list, tuple)) and x and all(isinstance(t, int) for t in x):
                row = {"prompt_ids": list(x)}
            else:
                raise DecodeError(f"input {i}: expected a string, a list of {{'role', 'content'}} messages or a list "
                                  f"of token ids, got {type(x).__name__} {str(x)[:60]!r}")
            out.append(Prompt(i, i, tuple(row_ids(row, self.tokenizer, chat, f"input {i}", self.cfg.vocab_size))))
        return out

    def text(self, tokens) -> str | None:
        return self.tokenizer.decode(tokens) if self.tokenizer is not None and self.tokenizer.can_decode else None

    def decode(self, prompts, opts: DecodeOptions, *,
               on_row: Callable[[Prompt, RowResult], None] = lambda p, r: None, progress=None) -> RunSummary:
        """The token level (decode.py): `decode_prompts` (prompts checked there, unless they come as its
        `CheckedPrompts`), every row handed to `on_row(prompt, row)` as it finishes with its text and prompt
        length; verify mode's policy starts from what it learned in this sampler's earlier calls."""
        def with_text(p, r):
            ar = r.ar and dataclasses.replace(r.ar, text=self.text(r.ar.tokens), prompt_tokens=len(p.ids))
            on_row(p, dataclasses.replace(r, text=self.text(r.tokens), prompt_tokens=len(p.ids), ar=ar))
        summary = decode_prompts(self.params, self.cfg, prompts, opts, mesh=self.mesh, on_row=with_text,
                                 progress=progress, draft_memory=self.draft_memory)
        self.draft_memory = summary.draft_memory
        return summary

    def __call__(self, inputs: Sequence, *, chat: bool = False, **options) -> list[RowResult]:
        """Complete every input (see `prompts`); `options` as in `options` (SBD by default, mode="ar" for the
        baseline). Returns one `RowResult` per input, in order, with its text ("" without a tokenizer) and prompt
        length; `self.last_summary` holds the run's summary."""
        opts = self.options(**options)
        prompts = self.prompts(inputs, chat=chat)
        rows: dict = {}
        self.last_summary = self.decode(prompts, opts, on_row=lambda p, r: rows.__setitem__(p.id, r))
        return [dataclasses.replace(rows[i], text=rows[i].text or "") for i in range(len(prompts))]
