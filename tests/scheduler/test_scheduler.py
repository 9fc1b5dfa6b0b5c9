"""The scheduler loop on a tiny float32 model: batching, prefix cache, chunking, retraction, aborts, stops."""

from __future__ import annotations

import logging

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from model_executor.sampling_params import SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import Scheduler, SchedulerConfig


def make_scheduler(path, *, slots=2048, max_running=16, tokenizer=None, **cfg) -> Scheduler:
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=max_running,
                                      max_total_tokens=slots))
    return Scheduler(runner, SchedulerConfig(max_running_requests=max_running, **cfg), tokenizer=tokenizer)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def run_all(s: Scheduler, max_steps: int = 10_000) -> dict[str, tuple[list[int], str]]:
    results: dict[str, list[int]] = {}
    finished = {}
    for _ in range(max_steps):
        if not s.has_work():
            break
        for out in s.step():
            results.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.rid] = out.finish_reason.kind
    assert not s.has_work(), "scheduler did not drain"
    return {rid: (results.get(rid, []), finished[rid]) for rid in finished}


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 320, (L,), generator=g).tolist() for L in lens]


@pytest.fixture(scope="module")
def alone_reference(tiny_llama):
    """Greedy outputs of each prompt run alone (no cache, one request at a time)."""
    path, _ = tiny_llama
    ps = prompts(12)
    ref = {}
    for i, p in enumerate(ps):
        s = make_scheduler(path, disable_radix_cache=True)
        s.add_request(f"r{i}", p, greedy(8 + i % 5))
        ref[f"r{i}"] = run_all(s)[f"r{i}"][0]
    return ps, ref


def test_batched_equals_alone(tiny_llama, alone_reference):
    ps, ref = alone_reference
    s = make_scheduler(tiny_llama[0], disable_radix_cache=True)
    for i, p in enumerate(ps):
        s.add_request(f"r{i}", p, greedy(8 + i % 5))
    out = run_all(s)
    assert {rid: toks for rid, (toks, _) in out.items()} == ref
    assert all(kind == "length" for _, kind in out.values())
    s.check_invariant()
    assert s.allocator.available_size() == s.allocator.num_slots


def test_arrival_mid_decode_joins_next_step(tiny_llama, alone_reference):
    ps, ref = alone_reference
    s = make_scheduler(tiny_llama[0], disable_radix_cache=True)
    tokens: dict[str, list[int]] = {}

    def step():
        for o in s.step():
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)

    s.add_request("r0", ps[0], greedy(8))
    s.add_request("r1", ps[1], greedy(9))
    step()  # extend of r0, r1
    step()  # decode
    assert len(s.running) == 2
    s.add_request("r2", ps[2], greedy(10))
    step()  # r2's extend: it joins without r0/r1 draining
    assert {r.rid for r in s.running} == {"r0", "r1", "r2"}
    step()  # one decode step now carries all three
    assert [len(tokens[r]) for r in ("r0", "r1", "r2")] == [3, 3, 2]
    while s.has_work():
        step()
    assert tokens == {"r0": ref["r0"], "r1": ref["r1"][:9], "r2": ref["r2"][:10]}


def test_chunked_prefill_equals_unchunked(tiny_llama, alone_reference):
    ps, ref = alone_reference
    s = make_scheduler(tiny_llama[0], disable_radix_cache=True, chunked_prefill_size=7)
    for i, p in enumerate(ps):
        s.add_request(f"r{i}", p, greedy(8 + i % 5))
    out = run_all(s)
    assert {rid: toks for rid, (toks, _) in out.items()} == ref
    s.check_invariant()


def test_chunked_prefill_lets_decode_continue(tiny_llama):
    s = make_scheduler(tiny_llama[0], disable_radix_cache=True, chunked_prefill_size=8)
    s.add_request("short", [5, 6, 7], greedy(20))
    s.step()
    s.add_request("long", list(range(3, 100)), greedy(2))
    produced_while_chunking = 0
    while s.chunked_req is not None or any(r.rid == "long" for r in s.waiting) or produced_while_chunking == 0:
        outs = s.step()
        produced_while_chunking += sum(len(o.new_token_ids) for o in outs if o.rid == "short")
        if not s.has_work():
            break
    assert produced_while_chunking >= 3  # the short request kept decoding between the long one's chunks


@pytest.mark.parametrize("mixed", [False, True])
def test_short_prompt_joins_a_long_prompts_prefill(tiny_llama, alone_reference, mixed):
    """A short prompt that arrives while a long one prefills in chunks is prefilled in the next chunk's batch
    (ahead of the long prompt, which takes the rest of the chunk): its first token, and its whole answer,
    come before the long prompt's prefill completes; both answers equal their runs alone. A prompt that fills
    the chunk leaves the long prompt half of it."""
    ps, ref = alone_reference
    short = ps[3]  # 3 tokens, 11 output tokens in the reference
    long_prompt = [3 + i % 300 for i in range(400)]  # 25 chunks of 16
    s = make_scheduler(tiny_llama[0], disable_radix_cache=True, chunked_prefill_size=16, enable_mixed_chunk=mixed)
    s.add_request("long", long_prompt, greedy(3))
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for o in s.step():
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)

    step()
    step()
    assert s.chunked_req.kv_len == 32
    s.add_request("r3", short, greedy(11))
    step()  # the short prompt's whole prefill, ahead of the long prompt's next chunk
    assert tokens == {"r3": ref["r3"][:1]}
    assert s.chunked_req.kv_len == 32 + 16 - len(short)  # the long prompt moved on in the same batch
    while "long" not in tokens:
        step()
    assert tokens["r3"] == ref["r3"]  # answered in full while the long prompt was still prefilling
    while s.has_work():
        step()
    alone = make_scheduler(tiny_llama[0], disable_radix_cache=True)
    alone.add_request("long", long_prompt, greedy(3))
    assert tokens["long"] == run_all(alone)["long"][0]
    s.check_invariant()


def test_long_prompt_keeps_half_the_chunk_when_a_prompt_fills_it(tiny_llama):
    s = make_scheduler(tiny_llama[0], disable_radix_cache=True, chunked_prefill_size=16)
    s.add_request("long", list(range(3, 103)), greedy(2))
    s.step()
    assert s.chunked_req.kv_len == 16
    s.add_request("fills", list(range(5, 21)), greedy(2))  # 16 tokens: the whole chunk
    s.step()
    assert s.chunked_req.rid == "long" and s.chunked_req.kv_len == 16 + 8
    assert s.reqs["fills"].kv_len == 16  # prefilled whole, in the same batch
    run_all(s)
    s.check_invariant()


def test_radix_cache_reuses_prefix(tiny_llama, alone_reference):
    ps, ref = alone_reference
    s = make_scheduler(tiny_llama[0])
    s.add_request("a", ps[3], greedy(11))
    first = run_all(s)["a"][0]
    s.add_request("b", ps[3], greedy(11))
    s.step()
    cached = s.reqs["b"].cached_tokens
    rest = run_all(s)
    assert cached == len(ps[3]) - 1
    assert first == ref["r3"]
    s.add_request("c", ps[3] + [7, 8, 9], greedy(5))
    out = run_all(s)
    assert out["c"][1] == "length"
    s.check_invariant()
    assert s.allocator.available_size() + s.tree.total_size() == s.allocator.num_slots
    assert s.tree.total_size() > 0
    assert rest["b"][0][-1] == ref["r3"][-1]


def test_prefix_cache_outputs_equal_reference_under_eviction(tiny_llama, alone_reference):
    ps, ref = alone_reference
    s = make_scheduler(tiny_llama[0], slots=160, max_running=4)
    for round_ in range(2):
        for i, p in enumerate(ps):
            s.add_request(f"r{i}-{round_}", p, greedy(8 + i % 5))
        out = run_all(s)
        for i in range(len(ps)):
            assert out[f"r{i}-{round_}"][0] == ref[f"r{i}"], (round_, i)
    s.check_invariant()
    assert s.allocator.available_size() + s.tree.total_size() == s.allocator.num_slots


def test_retraction_under_tiny_pool(tiny_llama, alone_reference):
    ps, ref = alone_reference
    # 12 prompts of up to 60 tokens + up to 12 outputs each, in 130 slots: decode must retract.
    for radix in (True, False):
        s = make_scheduler(tiny_llama[0], slots=130, max_running=12, disable_radix_cache=not radix,
                           new_token_ratio=0.0)  # reserve nothing at admission: decode must retract
        for i, p in enumerate(ps):
            s.add_request(f"r{i}", p, greedy(8 + i % 5))
        out = run_all(s)
        assert {rid: toks for rid, (toks, _) in out.items()} == ref
        assert s.num_retractions > 0
        s.check_invariant()


def test_abort_frees_slots(tiny_llama):
    s = make_scheduler(tiny_llama[0], max_running=2, disable_radix_cache=True)
    for i in range(4):
        s.add_request(f"r{i}", list(range(10, 30)), greedy(50))
    s.step()
    s.step()
    assert {r.rid for r in s.running} == {"r0", "r1"}
    s.abort("r0")  # running
    s.abort("r3")  # queued
    outs = {o.rid: o for o in s.step()}
    assert outs["r0"].finish_reason.kind == "abort" and outs["r3"].finish_reason.kind == "abort"
    s.check_invariant()
    s.abort("r1")
    s.abort("r2")
    run_all(s)
    assert s.allocator.available_size() == s.allocator.num_slots
    assert s.req_pool.available_size() == s.req_pool.size


def test_request_that_cannot_fit_is_rejected(tiny_llama):
    s = make_scheduler(tiny_llama[0], slots=64)
    s.add_request("big", list(range(3, 60)), greedy(30))
    s.add_request("ctx", [3] * 10, greedy(600))
    s.add_request("oov", [3, 99999], greedy(3))
    outs = {o.rid: o.finish_reason for o in s.step()}
    assert outs["big"].kind == "error" and "KV cache" in outs["big"].message
    assert outs["ctx"].kind == "error" and "context length" in outs["ctx"].message
    assert outs["oov"].kind == "error"
    assert not s.has_work()


def test_stop_token_ids_max_tokens_and_min_tokens(tiny_llama, alone_reference):
    ps, ref = alone_reference
    s = make_scheduler(tiny_llama[0])
    stop_tok = ref["r0"][3]
    s.add_request("a", ps[0], SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop_tok,)))
    first = ref["r0"].index(stop_tok)
    s.add_request("b", ps[0], SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop_tok,),
                                             min_new_tokens=first + 2))
    out = run_all(s)
    assert out["a"] == (ref["r0"][: first + 1], "stop")
    assert stop_tok not in out["b"][0][: first + 2]  # masked until min_tokens
    assert len(out["b"][0]) >= first + 2


def test_eos_stops_unless_ignored_and_not_before_min_tokens(tiny_llama):
    """EOS (forced with a logit bias) ends a request, as a stop token would; not with ignore_eos, and not
    before min_tokens (it cannot even be sampled then); the other requests of the batch go on."""
    eos = 2
    s = make_scheduler(tiny_llama[0])
    force = {"max_new_tokens": 6, "temperature": 0.0, "logit_bias": ((eos, 100.0),)}
    s.add_request("eos", [5, 6, 7], SamplingParams(**force))
    s.add_request("ignored", [5, 6, 7], SamplingParams(**force, ignore_eos=True))
    s.add_request("min", [5, 6, 7], SamplingParams(**force, min_new_tokens=3))
    s.add_request("plain", [5, 6, 7], greedy(6))
    out = run_all(s)
    assert out["eos"] == ([eos], "stop")
    assert out["ignored"] == ([eos] * 6, "length")
    assert eos not in out["min"][0][:3] and out["min"][0][3:] == [eos] and out["min"][1] == "stop"
    assert len(out["plain"][0]) == 6 and out["plain"][1] == "length"


class CharTokenizer:
    """Decodes token id t to a short string; enough for stop-string tests without a real vocabulary."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{t % 7}{'ab'[t % 2]}>" for t in ids)


def test_stop_string_across_token_boundary(tiny_llama, alone_reference):
    ps, ref = alone_reference
    tok = CharTokenizer()
    text = [tok.decode([t]) for t in ref["r1"]]
    # The end of token 2 and the start of token 3: spans a boundary.
    stop = text[2][-2:] + text[3][:2]
    s = make_scheduler(tiny_llama[0], tokenizer=tok)
    s.add_request("a", ps[1], SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True, stop=(stop,)))
    toks, kind = run_all(s)["a"]
    assert kind == "stop"
    full = tok.decode(toks)
    assert stop in full and stop not in tok.decode(toks[:-1])
    assert toks == ref["r1"][: len(toks)]


def test_lpm_policy_runs_everything(tiny_llama, alone_reference):
    ps, ref = alone_reference
    s = make_scheduler(tiny_llama[0], max_running=3, schedule_policy="lpm")
    for i, p in enumerate(ps):
        s.add_request(f"r{i}", p, greedy(8 + i % 5))
    out = run_all(s)
    assert {rid: toks for rid, (toks, _) in out.items()} == ref


def test_flush_cache(tiny_llama):
    s = make_scheduler(tiny_llama[0])
    s.add_request("a", list(range(3, 40)), greedy(4))
    run_all(s)
    assert s.tree.total_size() > 0
    assert s.flush_cache()
    assert s.tree.total_size() == 0
    assert s.allocator.available_size() == s.allocator.num_slots


def run_collecting(s: Scheduler, results: dict, finished: dict) -> None:
    while s.has_work():
        for out in s.step():
            results.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.rid] = out.finish_reason


def assert_all_free(s: Scheduler) -> None:
    s.check_invariant()
    assert s.allocator.available_size() + s._evictable() == s.allocator.num_slots
    assert s.req_pool.available_size() == s.req_pool.size
    if s.tree is not None:
        assert s.tree.protected_size() == 0


LONG = list(range(3, 100))  # 97 tokens: 13 chunks of 8


@pytest.mark.parametrize(("ratio", "radix"), [(0.0, True), (0.3, False)])
def test_chunked_prefill_waits_for_slots_instead_of_failing(tiny_llama, radix, ratio):
    """Long (97 + 2) and short (3 + 20) do not fit together in the pool; each alone does. The chunks
    shrink to what is free after the decode's reserve, the chunked request is retracted when the decode
    has no slot left, and both finish with the unconstrained outputs."""
    def run(slots):
        s = make_scheduler(tiny_llama[0], slots=slots, disable_radix_cache=not radix, chunked_prefill_size=8,
                           new_token_ratio=ratio)
        results, finished = {}, {}
        s.add_request("short", [5, 6, 7], greedy(20))
        for out in s.step():
            results.setdefault(out.rid, []).extend(out.new_token_ids)
        s.add_request("long", LONG, greedy(2))
        run_collecting(s, results, finished)
        assert {rid: r.kind for rid, r in finished.items()} == {"short": "length", "long": "length"}
        assert_all_free(s)
        return results

    assert run({0.0: 105, 0.3: 110}[ratio]) == run(2048)


def fail_rows(s: Scheduler, bad_rid: str, mode: ForwardMode | None = None):
    """Make every forward batch that holds bad_rid's request row raise (only in mode, if given)."""
    build = s.runner.build_batch

    def faulty(batch_mode, input_ids, rows, *args, **kw):
        bad = s.reqs.get(bad_rid)
        if bad is not None and bad.req_pool_idx in rows and mode in (None, batch_mode):
            raise RuntimeError("injected fault")
        return build(batch_mode, input_ids, rows, *args, **kw)

    s.runner.build_batch = faulty


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
@pytest.mark.parametrize("radix", [False, True])
def test_a_failing_request_fails_alone(tiny_llama, alone_reference, caplog, mode, radix):
    ps, ref = alone_reference
    s = make_scheduler(tiny_llama[0], disable_radix_cache=not radix, chunked_prefill_size=16)
    fail_rows(s, "r4", mode)
    for i, p in enumerate(ps):
        s.add_request(f"r{i}", p, greedy(8 + i % 5))
    results, finished = {}, {}
    with caplog.at_level(logging.ERROR, logger="duet.scheduler"):
        run_collecting(s, results, finished)
    assert finished["r4"].kind == "error" and "injected fault" in finished["r4"].message
    assert any("r4" in rec.getMessage() and "injected fault" in rec.getMessage() for rec in caplog.records)
    assert {rid: results.get(rid, []) for rid in ref if rid != "r4"} == {k: v for k, v in ref.items() if k != "r4"}
    assert all(finished[rid].kind == "length" for rid in ref if rid != "r4")
    if mode is ForwardMode.DECODE:
        assert results["r4"] == ref["r4"][:1]  # its extend ran; the first decode step failed
    assert_all_free(s)


def test_a_failing_stop_check_fails_that_request_only(tiny_llama, alone_reference):
    ps, ref = alone_reference

    class BadTokenizer(CharTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            if len(ids) >= 3:
                raise ValueError("tokenizer broke")
            return super().decode(ids, skip_special_tokens)

    s = make_scheduler(tiny_llama[0], tokenizer=BadTokenizer())
    s.add_request("bad", ps[0], greedy(8, stop=("zz",)))  # only requests with stop strings decode
    s.add_request("good", ps[1], greedy(9))
    results, finished = {}, {}
    run_collecting(s, results, finished)
    assert finished["bad"].kind == "error" and "tokenizer broke" in finished["bad"].message
    assert results["bad"] == ref["r0"][:3]
    assert (results["good"], finished["good"].kind) == (ref["r1"], "length")
    assert_all_free(s)


def test_a_failing_admission_fails_that_request_only(tiny_llama, alone_reference):
    ps, ref = alone_reference
    s = make_scheduler(tiny_llama[0])
    s.add_request("warm", ps[2], greedy(3))  # leaves a cached prefix that "bad" matches and locks
    run_all(s)
    match = s._match

    def faulty_match(req):
        if req.rid == "bad":  # fail inside _admit, after the matched prefix was locked
            s.req_pool.alloc = broken_alloc
        return match(req)

    real_alloc = s.req_pool.alloc

    def broken_alloc():
        s.req_pool.alloc = real_alloc
        raise RuntimeError("no row for you")

    s._match = faulty_match
    s.add_request("bad", ps[2] + [9, 9], greedy(3))
    s.add_request("good", ps[1], greedy(9))
    out = run_all(s)
    assert out["bad"] == ([], "error")
    assert out["good"] == (ref["r1"], "length")
    assert_all_free(s)


def test_a_failing_add_request_fails_that_request_only(tiny_llama, alone_reference):
    ps, ref = alone_reference
    s = make_scheduler(tiny_llama[0])
    check = s._admission_error
    s._admission_error = lambda req: (_ for _ in ()).throw(KeyError("boom")) if req.rid == "bad" else check(req)
    s.add_request("bad", ps[0], greedy(4))
    s.add_request("good", ps[1], greedy(9))
    out = run_all(s)
    assert out == {"bad": ([], "error"), "good": (ref["r1"], "length")}
    assert_all_free(s)


@pytest.mark.parametrize("radix", [False, True])
def test_abort_the_chunked_request(tiny_llama, radix):
    def run(abort: bool):
        s = make_scheduler(tiny_llama[0], disable_radix_cache=not radix, chunked_prefill_size=8)
        s.add_request("short", [5, 6, 7], greedy(12))
        s.add_request("long", LONG, greedy(4))
        results, finished = {}, {}
        while abort and (s.chunked_req is None or s.chunked_req.kv_len < 24):
            for out in s.step():
                results.setdefault(out.rid, []).extend(out.new_token_ids)
        if abort:
            assert s.chunked_req.rid == "long" and "short" in results  # mid-prefill while short decodes
            s.abort("long")
            assert s.chunked_req is None
            s.check_invariant()
        run_collecting(s, results, finished)
        assert_all_free(s)
        return results, {rid: r.kind for rid, r in finished.items()}

    results, kinds = run(abort=True)
    assert kinds == {"short": "length", "long": "abort"} and not results["long"]
    assert results["short"] == run(abort=False)[0]["short"]
