"""How two token-id sequences differ: where they first part, and how many single-token edits
(insertions, deletions, substitutions: Levenshtein distance) turn one into the other. One
inserted token is 1 edit, not "every later position" as a position-wise count would say."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

# above this many cells (after trimming the common prefix and suffix) the exact distance is
# replaced by the edit count of difflib's opcodes, an upper bound, so a pathological pair of
# long replies cannot stall a session server
EXACT_CELLS = 1_000_000


@dataclass(frozen=True)
class TokenDiff:
    first_divergence: int | None  # index of the first differing position (None: equal)
    edits: int  # single-token edits from `a` to `b`

    @property
    def equal(self) -> bool:
        return self.first_divergence is None


def token_diff(a: list[int], b: list[int]) -> TokenDiff:
    n = min(len(a), len(b))
    start = next((i for i in range(n) if a[i] != b[i]), n)
    if start == len(a) == len(b):
        return TokenDiff(None, 0)
    end = 0  # common suffix, not overlapping the prefix
    while end < n - start and a[len(a) - 1 - end] == b[len(b) - 1 - end]:
        end += 1
    x, y = a[start : len(a) - end], b[start : len(b) - end]
    return TokenDiff(start, _edits(x, y))


def _edits(x: list[int], y: list[int]) -> int:
    if not x or not y:
        return max(len(x), len(y))
    if len(x) * len(y) > EXACT_CELLS:
        ops = difflib.SequenceMatcher(None, x, y, autojunk=False).get_opcodes()
        return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")
    prev = list(range(len(y) + 1))
    for i, tx in enumerate(x, 1):
        row = [i]
        for j, ty in enumerate(y, 1):
            row.append(min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (tx != ty)))
        prev = row
    return prev[-1]
