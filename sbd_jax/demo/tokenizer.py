"""A character-level tokenizer built locally with the `tokenizers` library (no download): one id per
printable ASCII character plus newline, and the specials <pad>, <bos>, <eos> and the SBD mask token <m>.
Saved as a standard `tokenizer.json`, so `decode.py` and `transformers` load it from the model directory."""
from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ("<pad>", "<bos>", "<eos>", "<m>", "<unk>")


def build_char_tokenizer(charset: str = string.printable.replace("\t", "").replace("\r", "")
                         .replace("\x0b", "").replace("\x0c", "")) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in charset:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {name.strip("<>"): tok.token_to_id(name) for name in SPECIALS}


def save(tok: Tokenizer, directory: str | Path) -> Path:
    """tokenizer.json + tokenizer_config.json (names the special tokens, as transformers expects)."""
    import json
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "mask_token": "<m>", "unk_token": "<unk>"}, indent=2))
    return d / "tokenizer.json"
