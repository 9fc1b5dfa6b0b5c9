"""NGRAM proposals (scheduler/ngram.py) and the drafting policy (scheduler/speculative.py)."""

from __future__ import annotations

import random

from model_executor.sampling_params import SamplingParams
from scheduler.ngram import NgramIndex
from scheduler.req import Req
from scheduler.speculative import SpeculativeConfig, Speculator


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest suffix (hi down to lo) with an earlier occurrence; the tokens after the most recent one."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_proposes_what_followed_the_longest_most_recent_match():
    idx = NgramIndex(1, 4)
    idx.extend([1, 2, 3, 4, 9, 2, 3, 4, 7, 5, 2, 3, 4])
    # "2 3 4" occurred twice before; the most recent was followed by 7 5.
    assert idx.propose(2) == [7, 5]
    idx.extend([7])
    assert idx.propose(3) == [5, 2, 3]  # "2 3 4 7" matches the longest
    assert NgramIndex(1, 4).propose(3) == []
    fresh = NgramIndex(2, 4)
    fresh.extend([5, 6, 7, 8])
    assert fresh.propose(3) == []  # no suffix of 2+ tokens seen before, and the last one never matches itself


def test_incremental_index_equals_brute_force():
    rng = random.Random(0)
    for lo, hi in ((1, 12), (2, 3), (3, 3)):
        idx = NgramIndex(lo, hi)
        tokens: list[int] = []
        for _ in range(400):
            t = rng.randrange(6)
            tokens.append(t)
            idx.extend([t])
            assert idx.propose(5) == brute_force(tokens, 5, lo, hi), (lo, hi, tokens)


def _req(rid: str, prompt: list[int], **kw) -> Req:
    req = Req(rid, prompt, SamplingParams(max_new_tokens=64, temperature=0.0, **kw))
    req.output_ids = [2]
    req.num_sampled = 1
    return req


def test_drafts_skip_grammar_and_seeded_requests_and_respect_max_tokens():
    spec = Speculator(SpeculativeConfig("NGRAM", 4))
    prompt = [1, 2, 3, 4, 5, 6, 1]  # the output starts with 2: "1 2" matched, then 3 4 5 ...
    plain = _req("a", prompt)
    seeded = _req("b", prompt, seed=3)
    seeded.params = SamplingParams(max_new_tokens=64, temperature=0.8, seed=3)
    grammar = _req("c", prompt)
    grammar.grammar = object()
    short = _req("d", prompt)
    short.max_output = 3  # two tokens left: at most one draft
    assert spec.drafts([plain, seeded, grammar, short], room=100) == [[3, 4, 5], [], [], [3]]


def test_a_batch_draft_budget_is_shared():
    spec = Speculator(SpeculativeConfig("NGRAM", 5, max_batch_drafts=6))
    reqs = [_req(str(i), [1, 2, 3, 4, 5, 6, 1]) for i in range(4)]
    drafts = spec.drafts(reqs, room=100)
    assert [len(d) for d in drafts] == [2, 2, 1, 1]
    assert [len(d) for d in spec.drafts(reqs, room=3)] == [1, 1, 1, 0]
    small = Speculator(SpeculativeConfig("NGRAM", 5, max_batch_size=3))
    assert small.drafts(reqs, room=100) == [[], [], [], []]  # more requests decode than it drafts for
    assert all(small.drafts(reqs[:3], room=100))


def test_missing_drafts_back_off_and_a_hit_resets():
    spec = Speculator(SpeculativeConfig("NGRAM", 4, miss_limit=2, max_backoff_steps=4))
    req = _req("a", [1, 2, 3, 1])

    def proposing_steps(n: int) -> int:
        count = 0
        for _ in range(n):
            if spec.drafts([req], room=100)[0]:
                count += 1
                spec.record(req, 3, 0)
        return count

    assert proposing_steps(2) == 2  # two misses, then a pause of 1, 2, 4, 4 ... steps
    assert proposing_steps(20) < 8
    spec.record(req, 3, 1)
    assert req.spec.skip == 0 or req.spec.backoff == 0
    req.spec.skip = 0
    assert proposing_steps(2) == 2
