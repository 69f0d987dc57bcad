"""What the tokenized store (store.py) hands the packer (data.py): `Documents`, and the error both raise,
`DataError`. Its own module so that the two import it and not each other."""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from ..config import ConfigError


class DataError(ConfigError):
    """A dataset that cannot be used as configured (missing file/field, no usable rows...)."""


@dataclasses.dataclass(frozen=True)
class Documents:
    """Tokenized documents in one flat array: document i is values[offsets[i]:offsets[i + 1]]."""

    values: np.ndarray  # int32
    offsets: np.ndarray  # int64 [n + 1]
    n_prompt: np.ndarray  # int64 [n]: each document's loss-masked prefix
    digest: str | None = None  # ContentDigest of the documents (a resumed run checks it is training on the same)

    def __len__(self) -> int:
        return len(self.n_prompt)

    @classmethod
    def from_lists(cls, docs: list[list[int]], n_prompt: list[int] | None = None) -> Documents:
        values = np.concatenate([np.asarray(d, np.int32) for d in docs]) if docs else np.zeros(0, np.int32)
        offsets = np.cumsum([0] + [len(d) for d in docs], dtype=np.int64)
        n_prompt = np.asarray(np.zeros(len(docs)) if n_prompt is None else n_prompt, np.int64)
        content = ContentDigest()
        content.add(np.diff(offsets), values, n_prompt)
        return cls(values, offsets, n_prompt, content.hexdigest())


class ContentDigest:
    """sha256 over the documents' lengths, tokens and prompt lengths, added batch by batch as a store is written."""

    def __init__(self):
        self._h = hashlib.sha256()

    def add(self, lengths, values, n_prompt) -> None:
        for a, dtype in ((lengths, np.int64), (values, np.int32), (n_prompt, np.int64)):
            self._h.update(np.ascontiguousarray(a, dtype).tobytes())

    def hexdigest(self) -> str:
        return self._h.hexdigest()
