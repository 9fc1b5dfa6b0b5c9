"""NGRAM drafts (prompt lookup): the tokens that followed the most recent earlier occurrence of the request's
longest matching suffix, from its own prompt and output. No model; pure Python.

`NgramIndex` is one request's incremental state: for every n in [min_n, max_n] it maps each n-gram of the
request's tokens to the position just after its most recent occurrence that has a token after it. Appending
a token adds the n-grams that end just before it (they now have a follower), max_n - min_n + 1 dictionary
writes, so a step costs the same whatever the prompt's length; the prompt is indexed once, when the request
first asks for a draft.

A proposal: for n from max_n down to min_n, the suffix of n tokens is looked up; the first hit gives the
position p after an earlier occurrence, and the draft is tokens[p : p + k]. The last occurrence is excluded
by construction (the suffix itself has no follower yet), so a hit always points into the past.
"""

from __future__ import annotations


class NgramIndex:
    __slots__ = ("last", "max_n", "min_n", "tokens")

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # (n-gram as a tuple) -> the position after its most recent occurrence that has a follower.
        self.last: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: list[int]) -> None:
        tokens, last, lo, hi = self.tokens, self.last, self.min_n, self.max_n
        for token in new_tokens:
            end = len(tokens)  # the n-grams ending at end - 1 now have the follower at `end`
            window = tuple(tokens[max(0, end - hi):end])
            for n in range(lo, min(hi, end) + 1):
                last[window[-n:]] = end
            tokens.append(token)

    def sync(self, all_tokens: list[int]) -> None:
        """Index the tokens of all_tokens (prompt + output so far) not indexed yet."""
        if len(all_tokens) > len(self.tokens):
            self.extend(all_tokens[len(self.tokens):])

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens following the longest suffix that occurred before (empty: no match)."""
        tokens = self.tokens
        size = len(tokens)
        if k <= 0 or size < self.min_n + 1:
            return []
        window = tuple(tokens[max(0, size - self.max_n):])
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            pos = self.last.get(window[-n:])
            if pos is not None:
                return tokens[pos:pos + k]
        return []
