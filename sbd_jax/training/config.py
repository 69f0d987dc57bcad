"""Training configuration: frozen dataclasses loaded by `sbd_jax.config.load_config(TrainConfig, path, overrides)`
(strict keys, `a.b=value` overrides). One YAML file = one `TrainConfig`; see configs/tiny_sbd.yaml."""
from __future__ import annotations

import dataclasses
import math

from ..models.config import ModelConfig
from ..models.lora import LORA_TARGETS, AdapterLayout
from ..sharding import MeshConfig
from .spec import SBDConfig, StepOptions, require, require_choice


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: a local HF directory (`init_from`) or a random init of `config`."""

    init_from: str | None = None  # local HF-layout directory (never a hub name)
    config: ModelConfig | None = None  # architecture for a random init (used when init_from is null)
    init_std: float = 0.02
    param_dtype: str | None = None  # master-weight dtype override (float32 recommended for training)
    dtype: str | None = None  # compute dtype override (bfloat16 = mixed precision, f32 master weights)
    attention_impl: str | None = None  # "auto" | "xla" | "pallas" override
    remat: str | None = "full"  # ModelConfig.remat for training: recompute each layer in the backward pass
    scan_unroll: int | None = None  # layers per scan iteration in the training forward (ModelConfig.scan_unroll)
    mask_token_id: int | None = None  # the `<m>` id; overrides the checkpoint's config
    add_mask_token: bool = False  # no free id: grow embed/lm_head by one row and use id = old vocab size
    mask_init: str = "mean"  # the added row: "mean" of the rows, "zero" or "random" (model_source.add_mask_row)

    def __post_init__(self):
        require((self.init_from is None) != (self.config is None), "model: set exactly one of model.init_from "
                "(a local HF directory) and model.config (an architecture for a random init)")
        require(self.mask_token_id is None or not self.add_mask_token,
                "model: set only one of model.mask_token_id and model.add_mask_token")
        require_choice("model.mask_init", self.mask_init, ("mean", "zero", "random"))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """A local dataset read through `datasets`, tokenized and packed into rows of `seq_len` tokens."""

    # jsonl/json/parquet/arrow file(s) (glob ok) or a `save_to_disk` directory; a list of them: several sources
    # mixed by `weights` (each its own store)
    path: str | tuple[str, ...] | None = None
    weights: tuple[float, ...] | None = None  # one per source of a `path` list: shares of the documents drawn
    format: str = "auto"  # auto | json | parquet | arrow | disk
    split: str = "train"  # split to use when the source holds several
    mode: str = "auto"  # auto | text | sft  (auto: `text_field` present -> text, else prompt/response)
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    tokenizer: str | None = None  # tokenizer.json, or a directory with tokenizer.json (+ tokenizer_config.json)
    chat_template: bool = True  # SFT: wrap prompt/response with the tokenizer's chat template when it has one
    add_eos: bool = True  # append EOS to every document (not with a chat template: it ends the turn itself)
    seq_len: int = 512  # L: the packed row length (the SBD input is 2L)
    # C: static length of the SBD copy stream, which then holds no prompt (input L + C tokens instead of 2L;
    # None: C = L, the paper's [x ; x_hat]); the packer fits the rows to it (data.py). Needs sbd.block_align=response
    copy_len: int | None = None
    shuffle: bool = True
    seed: int = 0  # document order (per epoch) is a pure function of (seed, epoch)
    min_doc_tokens: int = 2  # shorter pieces are dropped (NTP needs 2 tokens)
    cache_dir: str | None = None  # `datasets` cache directory
    num_proc: int | None = None  # tokenization workers
    # where `prepare` keeps tokenized stores, one subdirectory per fingerprint of (files, tokenizer, settings);
    # null: $SBD_DATA_STORE or ~/.cache/sbd_jax/data. On several hosts: a shared filesystem, or each host its own
    store_dir: str | None = None
    # more records than this share unusable (missing field, empty, no response token inside seq_len, shorter
    # than min_doc_tokens) is an error naming the share and the first such record
    max_drop_share: float = 0.01

    def __post_init__(self):
        require_choice("data.format", self.format, ("auto", "json", "parquet", "arrow", "disk"))
        require_choice("data.mode", self.mode, ("auto", "text", "sft"))
        require(self.seq_len >= 2, f"data.seq_len must be >= 2, got {self.seq_len}")
        require(0.0 <= self.max_drop_share <= 1.0, f"data.max_drop_share must be in [0, 1], got {self.max_drop_share}")
        require(self.copy_len is None or 1 <= self.copy_len <= self.seq_len,
                f"data.copy_len must be in [1, seq_len={self.seq_len}] (or null), got {self.copy_len}")
        if isinstance(self.path, tuple):
            require(len(self.path) >= 1 and all(isinstance(p, str) and p for p in self.path),
                    f"data.path must be a path or a non-empty list of paths, got {list(self.path)}")
        if self.weights is not None:
            n = len(self.path) if isinstance(self.path, tuple) else 1
            require(len(self.weights) == n and all(w > 0 for w in self.weights), f"data.weights must be one "
                    f"positive number per data.path entry ({n}), got {list(self.weights)}")

    def paths(self) -> list[str]:
        """The sources: one path, or the entries of a `path` list."""
        return list(self.path) if isinstance(self.path, tuple) else [self.path]


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    schedule: str = "cosine"  # cosine | linear | constant (after warmup)
    warmup_steps: int = 200
    decay_steps: int | None = None  # None -> TrainConfig.steps
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    weight_decay: float = 0.1  # decoupled (AdamW); never applied to norms and biases
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0  # global-norm clipping; null = off
    grad_accum: int = 1  # microbatches per step (the batch is split, losses are exact global means)

    def __post_init__(self):
        require_choice("optim.schedule", self.schedule, ("cosine", "linear", "constant"))
        require(self.grad_accum >= 1, f"optim.grad_accum must be >= 1, got {self.grad_accum}")
        require(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        require(math.isfinite(self.lr) and self.lr > 0, f"optim.lr must be a finite number > 0, got {self.lr}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 500  # save every N steps (and always at the end)
    keep: int = 3  # keep the last K checkpoints
    async_save: bool = True
    export_hf: bool = True  # write the final weights in HF layout to <out_dir>/hf
    export_dtype: str | None = None  # dtype of the HF export (default: the master-weight dtype)

    def __post_init__(self):
        require(self.every >= 1 and self.keep >= 1, "checkpoint.every and checkpoint.keep must be >= 1")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """The `lora` section (absent/null: full fine-tuning). The base stays frozen; what trains is a rank-`rank` adapter
    A, B per target weight (scale alpha / rank) and, with model.add_mask_token, the added token's embedding row
    (and untied lm_head column). The optimizer holds state for those only (sbd_jax/models/lora.py)."""

    rank: int = 16
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(LORA_TARGETS)  # of q, k, v, o (attention), gate, up, down (MLP)
    base_dtype: str | None = None  # dtype the frozen base is held in (null: model.param_dtype); bfloat16 halves it
    export_merged: bool = False  # also write the merged full model to <out_dir>/hf (the adapter goes to adapter/)
    # the adapter (and the mask row) applies to copy-stream tokens only: the clean stream is the base model bit for
    # bit, so the NTP term is dropped (nothing to learn), the clean half runs without a backward pass, and lossless
    # decoding returns the base model's own AR output (sbd_jax/models/lora.py AdapterLayout)
    copy_only: bool = False

    def __post_init__(self):
        require(self.rank >= 1, f"lora.rank must be >= 1, got {self.rank}")
        require(self.alpha > 0, f"lora.alpha must be > 0, got {self.alpha}")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        require(not bad and len(self.targets) >= 1 and len(set(self.targets)) == len(self.targets),
                f"lora.targets must be distinct names among {list(LORA_TARGETS)}, got {list(self.targets)}")
        require(self.base_dtype in (None, "float32", "bfloat16", "float16"),
                f"lora.base_dtype must be float32, bfloat16 or float16 (or null), got {self.base_dtype!r}")
        require(not (self.copy_only and self.export_merged), "lora.copy_only adapters apply to copy tokens only and "
                "cannot be merged into full weights: set lora.export_merged=false")

    def layout(self, mask_row: int | None = None) -> AdapterLayout:
        """The adapter this section trains; `mask_row`: the id of a mask token added to the vocabulary."""
        return AdapterLayout(self.rank, float(self.alpha), self.targets, mask_row, self.copy_only)


@dataclasses.dataclass(frozen=True)
class DraftEvalConfig:
    """The `draft_eval` section: every `every` steps (and at the last), the draft-quality metric
    (sbd_jax/training/draft_quality.py) on held-out {"prompt_ids", "response_ids"} records, appended to
    <out_dir>/draft_quality.jsonl with the training seconds so far. null path: off."""

    path: str | None = None
    every: int = 100
    rows: int = 8  # records used (one forward over all of them)
    block_size: int = 16
    prompt_len: int = 192  # prompts left-truncated to this many tokens
    cont_len: int = 128  # continuations cut to this many tokens

    def __post_init__(self):
        for key in ("every", "rows", "prompt_len", "cont_len"):
            require(getattr(self, key) >= 1, f"draft_eval.{key} must be >= 1, got {getattr(self, key)}")
        require(2 <= self.block_size <= self.cont_len,
                f"draft_eval.block_size must be in [2, cont_len={self.cont_len}], got {self.block_size}")


RESUME_NEUTRAL = ("out_dir", "progress", "log_every", "allow_changes", "loss_chunk", "checkpoint.", "mesh.",
                  "draft_eval.",
                  "data.store_dir", "data.num_proc", "data.cache_dir", "data.max_drop_share",
                  "model.scan_unroll", "model.remat", "model.attention_impl", "lora.export_merged")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelSource
    data: DataConfig = DataConfig()
    sbd: SBDConfig = SBDConfig()
    optim: OptimConfig = OptimConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    lora: LoRAConfig | None = None  # LoRA fine-tuning (e.g. lora.rank=16); null: every weight trains
    draft_eval: DraftEvalConfig = DraftEvalConfig()
    out_dir: str = "runs/sbd"
    steps: int = 1000
    batch_size: int = 8  # global rows of L tokens per optimizer step
    seed: int = 0  # parameter init (random init) and the training PRNG (masks, block sizes)
    # lm_head + CE over time chunks of this many tokens, so [rows, 2L, vocab] logits never exist at once;
    # 0 = one piece, null = chunks of 1024 once a row's logits pass 256 MiB (training/loss.py auto_chunk)
    loss_chunk: int | None = None
    log_every: int = 1
    progress: bool = True  # tqdm progress bar
    # settings a resumed run may change on purpose (e.g. [steps]); any other change is refused (RESUME_NEUTRAL:
    # what never changes the result, like paths of outputs, logging, checkpointing, the mesh, remat)
    allow_changes: tuple[str, ...] = ()

    def __post_init__(self):
        for key in ("steps", "batch_size", "log_every"):
            require(getattr(self, key) >= 1, f"{key} must be >= 1, got {getattr(self, key)}")
        require(self.batch_size % self.optim.grad_accum == 0, f"batch_size ({self.batch_size}) must be a multiple "
                f"of optim.grad_accum ({self.optim.grad_accum})")
        require(self.loss_chunk is None or self.loss_chunk >= 0, f"loss_chunk must be >= 0 (or null), got {self.loss_chunk}")
        spec = self.step_options()  # validates the example options
        require(not (self.lora is not None and self.lora.copy_only and spec.ntp_only),
                "lora.copy_only trains the copy stream only: it has nothing to train with sbd.ntp_only")
        require(not spec.soft_targets or (self.lora is not None and self.lora.copy_only and self.mesh.context == 1),
                f"sbd.soft_targets ({spec.soft_targets}) takes the clean stream as the copy tokens' teacher: it needs "
                "lora.copy_only=true (the clean stream is then the base model) and mesh.context=1")
        block, largest = ("sbd.k_max", spec.k_max) if spec.block_size is None else ("sbd.block_size", spec.block_size)
        for key, n in (("data.seq_len", self.data.seq_len), ("data.copy_len", self.data.copy_len)):
            require(spec.ntp_only or n is None or n >= largest, f"{key} ({n}) is shorter than {block} ({largest}): "
                    "a block cannot be longer than a row or the copy stream")
        T = self.row_tokens()
        require(self.mesh.context < 2 or T % self.mesh.context == 0, f"mesh.context ({self.mesh.context}) must "
                f"divide the {T} tokens of a training row (data.seq_len {self.data.seq_len} + the copy stream "
                f"{0 if spec.ntp_only else self.data.copy_len or self.data.seq_len})")

    def row_tokens(self) -> int:
        """T: the tokens of one training row as the model sees it (L, plus the copy stream unless NTP-only)."""
        return self.data.seq_len + (0 if self.sbd.ntp_only else self.data.copy_len or self.data.seq_len)

    def step_options(self, mask_token_id: int | None = None) -> StepOptions:
        return StepOptions(mask_token_id, **dataclasses.asdict(self.sbd), copy_len=self.data.copy_len,
                           grad_accum=self.optim.grad_accum, loss_chunk=self.loss_chunk)
