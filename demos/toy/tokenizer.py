"""The demo's tokenizer, a BPE trained locally on the pretraining texts (no download) and saved as a standard
tokenizer.json (`sbd_jax.io.tokenizer`, decode.py and `transformers` load it). Every printable ASCII character
is in the alphabet, so any text round-trips; the specials are <pad>, <bos>, <eos>, the SBD mask <m> and <unk>.
As in the Llama-3 and Qwen tokenizers, numbers of up to three digits stay one token and words keep their
leading space: with numbers as tokens every step of "4+9=13;13+4=17" has the same token layout, while
characters would make where a step starts depend on how many digits an unfinished result has."""
from __future__ import annotations

import json
import string
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ("<pad>", "<bos>", "<eos>", "<m>", "<unk>")
ALPHABET = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
# numbers (1-3 digits) and words keep one leading space; any other character stands alone
PRE_TOKENIZE = r" ?\d{1,3}| ?[A-Za-z]+| ?[^\sA-Za-z\d]|\s"


def build_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> Tokenizer:
    """Train the BPE on `texts` (deterministic for the same texts and size)."""
    if vocab_size < len(SPECIALS) + len(ALPHABET):
        raise ValueError(f"vocab_size must be >= {len(SPECIALS) + len(ALPHABET)} (specials + printable ASCII), "
                         f"got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PRE_TOKENIZE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), initial_alphabet=ALPHABET,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {name.strip("<>"): tok.token_to_id(name) for name in SPECIALS}


def save(tok: Tokenizer, directory: str | Path) -> Path:
    """tokenizer.json + tokenizer_config.json (names the special tokens, as transformers expects)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "mask_token": "<m>", "unk_token": "<unk>"}, indent=2))
    return d / "tokenizer.json"
