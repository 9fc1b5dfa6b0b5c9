"""Overlap scheduling: reading a step's tokens after launching the next must change nothing users see.

A mixed workload (stops on token ids, strings and EOS at different steps, min_tokens, seeded sampling with
logprobs, two samples of one prompt, chunked prompts, a late arrival, an abort mid-stream) runs with overlap
off and on, with a roomy KV pool and with one small enough to force retraction; tokens, finish reasons,
logprobs and usage must be identical, and afterwards every slot is free or cached.
"""

from __future__ import annotations

import pytest
import torch

from model_executor.sampling_params import SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import Scheduler, SchedulerConfig


class CharTokenizer:
    """Decodes token id t to a short string: enough for stop strings without a real vocabulary."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{t % 7}{'ab'[t % 2]}>" for t in ids)


def make_scheduler(path, *, overlap: bool, slots: int, max_running: int = 16, **cfg) -> Scheduler:
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=max_running,
                                      max_total_tokens=slots))
    return Scheduler(runner, SchedulerConfig(max_running_requests=max_running, enable_overlap=overlap, **cfg),
                     tokenizer=CharTokenizer())


def workload() -> tuple[dict[str, tuple[list[int], SamplingParams]], dict[str, tuple[list[int], SamplingParams]]]:
    """(requests added before the first step, requests added after step 4)."""
    g = torch.Generator().manual_seed(1)

    def prompt(n):
        return torch.randint(3, 320, (n,), generator=g).tolist()

    def greedy(n, **kw):
        return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)

    stops = tuple(range(5, 320, 9))  # ~1 token in 9: stops land on different steps
    seeded = {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "top_logprobs": 3}
    shared = prompt(20)
    first = {
        "greedy": (prompt(12), greedy(12, ignore_eos=True)),
        "eos": (prompt(25), greedy(14)),
        "stop_ids": (prompt(7), greedy(16, stop_token_ids=stops)),
        "stop_ids2": (prompt(33), greedy(16, stop_token_ids=stops[::2])),
        "stop_str": (prompt(18), greedy(16, stop=("<3a>",), ignore_eos=True)),
        "min_tokens": (prompt(9), greedy(16, stop_token_ids=tuple(range(1, 320, 3)), min_new_tokens=5)),
        "seeded": (prompt(15), SamplingParams(max_new_tokens=10, seed=5, **seeded)),
        "n0": (shared, SamplingParams(max_new_tokens=9, seed=11, temperature=1.0)),
        "n1": (shared, SamplingParams(max_new_tokens=9, seed=12, temperature=1.0)),
        "chunked": (prompt(70), greedy(6, top_logprobs=2, ignore_eos=True)),
        "aborted": (prompt(10), greedy(30, ignore_eos=True)),
    }
    late = {"late": (prompt(40), greedy(8, ignore_eos=True)), "late_seeded": (prompt(5), SamplingParams(
        max_new_tokens=7, seed=3, **seeded))}
    return first, late


ABORT_AFTER = 3  # tokens seen by the client


def drive(s: Scheduler) -> dict:
    first, late = workload()
    for rid, (ids, params) in first.items():
        s.add_request(rid, ids, params)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    final = {}
    steps = 0
    while s.has_work():
        for out in s.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            logprobs.setdefault(out.rid, []).extend(
                (lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or [])
            if out.finish_reason is not None:
                reason = out.finish_reason
                final[out.rid] = (reason.kind, reason.matched, out.prompt_tokens, out.completion_tokens,
                                  out.cached_tokens)
        steps += 1
        if steps == 4:
            for rid, (ids, params) in late.items():
                s.add_request(rid, ids, params)
        if len(tokens.get("aborted", [])) >= ABORT_AFTER and "aborted" not in final:
            s.abort("aborted")
        assert steps < 2000, "the scheduler did not drain"
    assert set(final) == set(first) | set(late)
    return {"tokens": tokens, "final": final, "logprobs": logprobs,
            "decode_passes": s.runner.path_counts["decode_eager"]}


def assert_all_free(s: Scheduler) -> None:
    s.check_invariant()
    assert s.allocator.available_size() + s._evictable() == s.allocator.num_slots
    assert s.req_pool.available_size() == s.req_pool.size
    assert s.tree.protected_size() == 0


def assert_same_logprobs(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid, entries in a.items():
        assert len(entries) == len(b[rid]), rid
        for (ta, va, top_a), (tb, vb, top_b) in zip(entries, b[rid]):
            assert ta == tb and [i for i, _ in top_a] == [i for i, _ in top_b], rid
            assert [va] + [v for _, v in top_a] == pytest.approx([vb] + [v for _, v in top_b], abs=1e-4), rid


@pytest.mark.parametrize("slots", [2048, 170], ids=["roomy", "retracting"])
def test_overlap_and_mixed_chunks_give_the_same_outputs(tiny_llama, slots):
    runs = {}
    for overlap, mixed in ((False, False), (True, False), (True, True), (False, True)):
        s = make_scheduler(tiny_llama[0], overlap=overlap, slots=slots, chunked_prefill_size=16,
                           new_token_ratio=0.0, enable_mixed_chunk=mixed)
        runs[overlap, mixed] = drive(s)
        assert_all_free(s)
        if slots < 200:
            assert s.num_retractions > 0
        if mixed:  # decodes really ran inside extend batches: fewer decode-only passes
            assert runs[overlap, mixed]["decode_passes"] < runs[False, False]["decode_passes"]
    off = runs[False, False]
    for key, run in runs.items():
        assert run["tokens"] == off["tokens"], key
        assert run["final"] == off["final"], key
        assert_same_logprobs(run["logprobs"], off["logprobs"])
    # The workload really stops on each kind of stop, at different steps.
    kinds = {rid: f[0] for rid, f in off["final"].items()}
    assert kinds["stop_ids"] == kinds["stop_str"] == kinds["min_tokens"] == "stop"
    assert kinds["aborted"] == "abort" and len(off["tokens"]["aborted"]) == ABORT_AFTER
    assert len({len(off["tokens"][r]) for r in ("stop_ids", "stop_ids2", "stop_str", "min_tokens")}) > 1
    assert off["final"]["n0"][4] == off["final"]["n1"][4] == 0 and off["tokens"]["n0"] != off["tokens"]["n1"]


def test_overlap_reads_a_step_after_launching_the_next(tiny_llama):
    """With overlap, the first step's token arrives with the second step (it was launched, not read);
    the request that stops on a token id runs one extra, discarded decode step."""
    counts = {}
    for overlap in (False, True):
        s = make_scheduler(tiny_llama[0], overlap=overlap, slots=512)
        ids = list(range(10, 30))
        s.add_request("a", ids, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        first = s.step()
        assert [len(o.new_token_ids) for o in first] == ([] if overlap else [1])
        while s.has_work():
            s.step()
        ref = s.runner.path_counts["decode_eager"]
        # Stop on the 3rd token: with overlap the 4th decode was already launched when it is read.
        s2 = make_scheduler(tiny_llama[0], overlap=overlap, slots=512, disable_radix_cache=True)
        tokens = []
        s2.add_request("b", ids, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        while s2.has_work():
            tokens += [t for o in s2.step() for t in o.new_token_ids]
        s3 = make_scheduler(tiny_llama[0], overlap=overlap, slots=512, disable_radix_cache=True)
        s3.add_request("c", ids, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(tokens[2],)))
        out = []
        while s3.has_work():
            out += [t for o in s3.step() for t in o.new_token_ids]
        assert out == tokens[:3]
        assert s3.allocator.available_size() == s3.allocator.num_slots
        counts[overlap] = (ref, s3.runner.path_counts["decode_eager"])
    # Stopping by length never runs an extra step; stopping on a token runs exactly one with overlap.
    assert counts[True][0] == counts[False][0] == 7
    assert counts[False][1] == 2 and counts[True][1] == 3
