"""Encoding a very long text (a 20 MB document) in pieces, so that the tokenizer's peak memory follows a piece and not
the whole text (`tokenizers` keeps ~100 bytes of offsets and strings per token of an encoding: a 20 MB text peaked at
7 GB; bench/bench_long_document.py). A text is cut only where this tokenizer never merges across: after a newline
that follows a non-space and precedes a non-space, or before a space that follows a non-space and precedes a letter
or digit, and never inside an added token. Whether a tokenizer splits there is probed once on sample texts
(`PROBES`): every cut of every probe must give the same ids as the whole; a tokenizer that fails a probe (a prefix
space added to each piece, a normalizer that joins) encodes long texts whole, as before."""
from __future__ import annotations

import re

PIECE_CHARS = 1 << 20  # a text longer than this is encoded in pieces of about this many characters
# texts with cuts of both kinds, in code and prose, with digits, punctuation, tabs, non-ASCII letters and repeats
PROBES = ("def f(x):\n    return x\nclass A:\n\tpass\n", "a\n\nb\nc d  e\n x\n1 2\n", "Grüße aus Köln\nstraße 3.14 x",
          "foo bar.baz qux\n#comment\n  y = [1, 2]\nz\n", "αβγ δεζ\n中文 文字\nend", "x  \ny\n\n\nz w\r\nv u")
_CUT = re.compile(r"(?<=\S\n)(?=\S)|(?<=\S)(?= \w)")


def cuts(text: str) -> list[int]:
    """Every place `text` may be cut: the index of the next piece's first character (a non-space after a newline,
    or a space between a non-space and a word character)."""
    return [m.start() for m in _CUT.finditer(text) if 0 < m.start() < len(text)]


def splits_cleanly(encode) -> bool:
    """Whether `encode(text)` (no special tokens) equals the concatenation of its pieces at every cut of `PROBES`."""
    for text in PROBES:
        whole = encode(text)
        if any(encode(text[:i]) + encode(text[i:]) != whole for i in cuts(text)):
            return False
    return True


def pieces(text: str, added: tuple[str, ...], size: int | None = None) -> list[str]:
    """`text` cut into pieces of about `size` (PIECE_CHARS) characters at `cuts`, never inside an occurrence of an
    added token."""
    out, start, size = [], 0, size or PIECE_CHARS
    spans = [(m.start(), m.end()) for a in added if a and (" " in a or "\n" in a)
             for m in re.finditer(re.escape(a), text)]
    while len(text) - start > size:
        lo = start + size - 1  # one character before: what a cut's lookbehind reads
        window = text[lo:start + 2 * size + 1]
        cut = next((lo + i for i in cuts(window) if lo + i >= start + size and not any(s < lo + i < e for s, e in spans)),
                   None)
        if cut is None:  # no place to cut in the next `size` characters: the rest is one piece
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


class PieceEncoder:
    """A `tokenizers.Tokenizer`'s encode and encode_batch, a text longer than PIECE_CHARS encoded piece by piece
    where the tokenizer allows it (probed on the first such text) with its special tokens around the whole."""

    def __init__(self, hf):
        self.hf = hf
        self.added = tuple(t.content for t in hf.get_added_tokens_decoder().values())
        self._frame: tuple[list[int], list[int]] | None = None
        self._clean: bool | None = None

    def by_pieces(self) -> bool:
        """Whether long texts are encoded in pieces (probed once: `splits_cleanly` and the special tokens' frame)."""
        if self._clean is None:
            plain = lambda t: self.hf.encode(t, add_special_tokens=False).ids  # noqa: E731
            framed, bare = self.hf.encode("a", add_special_tokens=True).ids, plain("a")
            k = next((i for i in range(len(framed) - len(bare) + 1) if framed[i:i + len(bare)] == bare), None)
            self._frame = None if k is None else (framed[:k], framed[k + len(bare):])
            self._clean = self._frame is not None and splits_cleanly(plain)
        return self._clean

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= PIECE_CHARS or not self.by_pieces():
            return self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        ids: list[int] = []
        for piece in pieces(text, self.added):
            ids += self.hf.encode(piece, add_special_tokens=False).ids
        return self._frame[0] + ids + self._frame[1] if add_special_tokens else ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        short = [i for i, t in enumerate(texts) if len(t) <= PIECE_CHARS]
        out: list = [None] * len(texts)
        for i, e in zip(short, self.hf.encode_batch([texts[i] for i in short], add_special_tokens=add_special_tokens)):
            out[i] = e.ids
        return [self.encode(t, add_special_tokens) if ids is None else ids for t, ids in zip(texts, out)]
