"""The tokenizer stored in a GGUF file, rebuilt with `tokenizers` as llama.cpp tokenizes: a byte-level BPE from
the file's vocabulary and merges, the pre-tokenizer that `tokenizer.ggml.pre` names (llama.cpp's regex lists), control
tokens as special added tokens, BOS/EOS as llama.cpp adds them, and the tokenizer_config.json fields (chat template,
special tokens)."""
from __future__ import annotations

from pathlib import Path

from .gguf_meta import GGUFError, meta_value


_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# llama.cpp's regex lists (llm_tokenizer_bpe), each applied to the pieces of the one before, then byte-level
_SPLITS = {"llama3": [_LLAMA3_SPLIT], "qwen2": [_QWEN2_SPLIT],
           "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]"]}
# tokenizer.ggml.pre -> its llama.cpp family (llama-vocab.cpp; "gpt2" is accepted besides llama.cpp's "gpt-2")
PRE_TOKENIZERS = {"smollm": "smollm", "gpt-2": "gpt2", "gpt2": "gpt2", "default": "default",
                  **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), "llama3"),
                  **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), "qwen2")}
_CLEAN_SPACES = {"smollm": False, "qwen2": False}  # llama.cpp's clean_spaces (True for the other families)


def _pre_tokenizer(family: str):
    from tokenizers import Regex, pre_tokenizers as pt
    if family == "smollm":  # llama.cpp: `\p{N}` pieces, then GPT-2's regex (= the original SmolLM2 tokenizer.json)
        return pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    if family == "gpt2":
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    return pt.Sequence([pt.Split(Regex(r), behavior="isolated") for r in _SPLITS[family]]
                       + [pt.ByteLevel(add_prefix_space=False, use_regex=False)])


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id; a token not spelled in the byte-level alphabet (a mislabelled raw string) is respelled, as
    transformers does. Later duplicates win, as in llama.cpp's token_to_id."""
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = set(ByteLevel.alphabet())
    spell = {b: c for b, c in enumerate(_bytes_to_unicode())}
    return {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode()): i for i, t in enumerate(tokens)}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (byte b is spelled as the b-th entry)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _merges(merges: list[str]) -> list[tuple[str, str]]:
    """"a b" -> ("a", "b"), split at the first space after the first character (as llama.cpp does)."""
    out = []
    for m in merges:
        cut = m.find(" ", 1)
        if cut > 0:
            out.append((m[:cut], m[cut + 1:]))
    return out


def _post_processor(tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool):
    from tokenizers import processors
    specials = [(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on and i is not None]
    if not specials:
        return None
    head = f"{tokens[bos]} " if add_bos and bos is not None else ""
    tail = f" {tokens[eos]}" if add_eos and eos is not None else ""
    return processors.TemplateProcessing(single=f"{head}$A:0{tail}", pair=f"{head}$A:0{tail} {head}$B:1{tail}",
                                         special_tokens=sorted(set(specials)))


def build_tokenizer(meta: dict, path: Path):
    """-> (tokenizers.Tokenizer, tokenizer_config dict) from the file's vocabulary, as llama.cpp tokenizes: a
    byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizer `tokenizer.ggml.pre` names, control
    tokens (type 3) as special added tokens, user-defined ones (type 4) as plain added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"tokenizer.ggml.model {kind!r} in {str(path)!r} is not supported (supported: 'gpt2', "
                        "byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")  # llama.cpp reads a missing one as "default"
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"tokenizer.ggml.pre {pre!r} in {str(path)!r} is not supported (supported: "
                        f"{sorted(PRE_TOKENIZERS)})")
    family = PRE_TOKENIZERS[pre]
    tokens = list(meta_value(meta, "tokenizer.ggml.tokens", path))
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = _byte_level_vocab(tokens)
    try:
        bpe = models.BPE(vocab, _merges(meta_value(meta, "tokenizer.ggml.merges", path)),
                         ignore_merges=family == "llama3")  # llama.cpp: a whole word in the vocab is one token
    except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception
        raise GGUFError(f"cannot build a BPE tokenizer from {str(path)!r}: {e}") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(family)
    tok.decoder = decoders.ByteLevel()
    # a control token respelled into the byte alphabet is not added: it would get an id past the vocabulary
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == 3 and t in vocab])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4 and t in vocab])
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding", "unknown")}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", family == "llama3"))  # llama.cpp's defaults
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    post = _post_processor(tokens, ids["bos"], ids["eos"], add_bos, add_eos)
    if post is not None:
        tok.post_processor = post
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": add_eos,
            "clean_up_tokenization_spaces": _CLEAN_SPACES.get(family, True),
            "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 2048))}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"), ("unk_token", "unknown")):
        if ids[key] is not None and 0 <= ids[key] < len(tokens):
            conf[name] = tokens[ids[key]]
    if meta.get("tokenizer.chat_template"):
        conf["chat_template"] = meta["tokenizer.chat_template"]
    return tok, conf
