"""A pseudo-random permutation of range(n) evaluated one index at a time, in O(1) memory: the epoch order of
a corpus of any size without materializing a permutation array (a 70B-token corpus has ~10^8 documents).

A balanced Feistel network over the smallest even number of bits that covers n (a bijection of [0, 4^h) for
any round function), restricted to [0, n) by cycle walking (re-applying it until the value falls inside; the
domain is < 4n, so ~2 applications on average). The round function is splitmix64's finalizer keyed per round.
"""
from __future__ import annotations

_M64 = (1 << 64) - 1
_ROUNDS = 6


def mix64(x: int) -> int:
    """splitmix64's finalizer: a bijective 64-bit mixer."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Permutation:
    """`perm(i)` for i in range(n): a permutation of range(n) that is a pure function of (n, *key)."""

    def __init__(self, n: int, *key: int):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        self._h = (max((self.n - 1).bit_length(), 2) + 1) // 2
        self._mask = (1 << self._h) - 1
        k = 0x6A09E667F3BCC908
        for part in key:
            k = mix64(k ^ (int(part) & _M64))
        self._keys = [mix64(k + 0x9E3779B97F4A7C15 * (r + 1) & _M64) for r in range(_ROUNDS)]

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} outside range({self.n})")
        h, mask, x = self._h, self._mask, i
        while True:
            left, right = x >> h, x & mask
            for k in self._keys:
                left, right = right, left ^ (mix64(right ^ k) & mask)
            x = (left << h) | right
            if x < self.n:
                return x
