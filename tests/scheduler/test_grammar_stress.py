"""A seeded stress of constrained decoding in the scheduler (default model, in process): random combinations
of the sampling fields the HTTP fuzz sends (tests/reliability/test_reliability_fuzz.py's tamed bodies) with grammars,
n copies, bans that leave a grammar few or no tokens (min_tokens, stop_token_ids, logit_bias -100),
penalties, temperatures up to the fuzz's extremes, seeds, logprobs and prompt logprobs, aborts mid-run, under
overlap on and off, with chunked prefill, mixed chunks and a KV pool small enough to retract.

Never a crash, never a lost request: a constrained request must finish with a grammar-valid outcome, never
with "the grammar rejected the sampled token 0" (a row whose every logit was -inf or NaN)."""

from __future__ import annotations

import random
import re

import pytest
import torch

from model_executor.sampler import Sampler, SamplingBatchInfo
from model_executor.sampling_params import GrammarSpec, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.test_scheduler import make_scheduler, run_all

GRAMMARS = [
    GrammarSpec("json_object"),
    GrammarSpec("json_schema", '{"properties":{"a":{"type":"integer"}},"required":["a"],"type":"object"}'),
    GrammarSpec("regex", "(yes|no)"),
    GrammarSpec("regex", "[0-9]{1,3}"),
    GrammarSpec("regex", ""),  # only EOS is allowed
    GrammarSpec("ebnf", 'root ::= "a" | "b" "c"'),
]
# Temperatures the fuzz sends: greedy, just above the greedy cut, ordinary, and beyond float32's range
# (the request's float64 becomes inf in the sampler's float32 tensor).
TEMPERATURES = [0.0, 1.5e-5, 0.7, 1.0, 1e6, 1e39, 1e308]
CONFIGS = {
    "plain": {},
    "overlap": {"enable_overlap": True},
    "overlap-chunked-mixed": {"enable_overlap": True, "chunked_prefill_size": 8, "enable_mixed_chunk": True},
    "overlap-retract": {"enable_overlap": True, "new_token_ratio": 0.0},
}


@pytest.mark.parametrize("temperature", [1e39, 1e308, float("inf")])
def test_a_temperature_beyond_float32_never_samples_a_banned_token(temperature):
    """Regression (the fuzz's "grammar rejected the sampled token 0"): a temperature beyond float32's range
    became inf in the sampler, -inf / inf is NaN and argmax prefers NaN, so the first banned token (0) came
    out of every row with a ban (a grammar mask, min_tokens). Each filter path: plain race, top-k first, the
    full sort (top-p), min-p, seeded."""
    g = torch.Generator().manual_seed(0)
    vocab = 64
    logits = torch.randn(5, vocab, generator=g) * 4
    allowed = torch.rand(5, vocab, generator=g) < 0.2
    allowed[:, 0] = False
    allowed[torch.arange(5), torch.randint(1, vocab, (5,), generator=g)] = True
    logits[~allowed] = float("-inf")
    params = [SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, top_k=5),
              SamplingParams(temperature=temperature, top_p=0.5), SamplingParams(temperature=temperature, min_p=0.5),
              SamplingParams(temperature=temperature, seed=7)]
    for step in range(20):
        info = SamplingBatchInfo.from_params(params, [step] * 5, "cpu", vocab_size=vocab)
        tokens = Sampler()(logits.clone(), info).next_token_ids
        assert allowed[torch.arange(5), tokens].all(), (step, tokens.tolist())


def test_constrained_request_at_a_huge_temperature(runner_and_tok):
    """The same end to end: a grammar with temperature 1e308 ends grammar-valid (it was a 500 on token 0),
    and min_tokens still keeps EOS out at that temperature (EOS, banned, came out first)."""
    runner, tok = runner_and_tok
    s = Scheduler(runner, SchedulerConfig(max_running_requests=16, enable_overlap=True), tokenizer=tok)
    prompt = tok.encode("Is water wet?")
    for i in range(4):
        s.add_request(f"g{i}", prompt, SamplingParams(max_new_tokens=8, temperature=1e308, seed=i,
                                                      grammar=GrammarSpec("regex", "(yes|no)")))
    s.add_request("min", prompt, SamplingParams(max_new_tokens=4, min_new_tokens=3, temperature=1e308, seed=1))
    out = run_all(s)
    for i in range(4):
        ids, reason = out[f"g{i}"]
        assert reason == "stop" and re.fullmatch("(yes|no)", tok.decode(ids, skip_special_tokens=True)), out[f"g{i}"]
    assert len(out["min"][0]) >= 3, out["min"]
    s.check_invariant()
    assert s.flush_cache()  # the next test's scheduler shares the runner's KV pool


def random_params(rng: random.Random, vocab: int, eos: int, grammar: bool) -> SamplingParams:
    max_new = rng.randint(1, 8)
    hot = [eos, 0, 1, 15, 16, 17, 90, 92, 198, 330]  # EOS, specials, digits, "{" "}" "\n", ...
    bias = ()
    if rng.random() < 0.3:
        bias = tuple(sorted({rng.choice(hot + [rng.randrange(vocab)]): rng.choice([-100.0, 100.0, 3.5])
                             for _ in range(rng.randint(1, 4))}.items()))
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=rng.choice(TEMPERATURES),
        top_p=rng.choice([1.0, 1.0, 0.5, 1e-6]),
        top_k=rng.choice([-1, -1, 1, 5, 2000]),
        min_p=rng.choice([0.0, 0.0, 0.5, 1.0]),
        seed=rng.choice([None, rng.randrange(-(2**63), 2**63)]),
        stop_token_ids=tuple(rng.sample(hot, rng.randint(0, 3))) if rng.random() < 0.4 else (),
        ignore_eos=rng.random() < 0.3,
        min_new_tokens=rng.randint(0, min(2, max_new)),
        top_logprobs=rng.choice([None, None, 0, 5]),
        prompt_logprob_start=rng.choice([None, None, 0]),
        presence_penalty=rng.choice([0.0, 0.0, 2.0, -2.0]),
        frequency_penalty=rng.choice([0.0, 0.0, 1.5]),
        repetition_penalty=rng.choice([1.0, 1.0, 2.0, 1e-300]),
        logit_bias=bias,
        grammar=rng.choice(GRAMMARS) if grammar else None,
    )


def drive(s: Scheduler, rng: random.Random, vocab: int, eos: int, num: int) -> dict[str, str]:
    """Submit `num` random requests (each with n copies) in waves, abort a few mid-run; returns every request's
    finish reason kind (or its error message)."""
    finished: dict[str, str] = {}
    submitted = 0
    group = 0
    steps = 0
    while submitted < num or s.has_work():
        if submitted < num and rng.random() < 0.5:
            params = random_params(rng, vocab, eos, grammar=rng.random() < 0.7)
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
            for copy in range(rng.choice([1, 1, 2, 4])):
                s.add_request(f"g{group}-{copy}", prompt, params)
                submitted += 1
            group += 1
            for req in s.grammars.queue:  # compiled before the next step: the same batches on every run
                req.grammar_future.result()
        if rng.random() < 0.03 and s.reqs:
            s.abort(rng.choice(sorted(s.reqs)))
        for out in s.step():
            if out.finish_reason is not None:
                r = out.finish_reason
                finished[out.rid] = r.kind if r.kind != "error" else f"error: {r.message}"
        steps += 1
        assert steps < 5000, "the scheduler did not drain"
    return finished


@pytest.fixture(scope="module")
def runner_and_tok(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    # One model for every configuration (each run drains it and flushes its cache); 96 KV slots: 16 running
    # requests with prompts of up to 20 tokens and 8 outputs each do not fit, so decode may retract.
    return make_scheduler(model_dir, slots=96).runner, tok


@pytest.mark.parametrize("config", list(CONFIGS))
def test_constrained_requests_never_fail(runner_and_tok, config):
    runner, tok = runner_and_tok
    vocab = runner.model_config.vocab_size
    eos = min(runner.model_config.eos_token_ids)
    s = Scheduler(runner, SchedulerConfig(max_running_requests=16, **CONFIGS[config]), tokenizer=tok)
    finished = drive(s, random.Random(f"grammar-stress-{config}"), vocab, eos, num=48)
    errors = {rid: kind for rid, kind in finished.items() if kind.startswith("error")}
    assert not errors, errors
    assert len(finished) >= 48
    if config == "overlap-retract":
        assert s.num_retractions > 0  # the pool is small enough: a retracted constrained request re-admitted
    s.check_invariant()
    assert s.flush_cache()  # the next test's scheduler shares the runner's KV pool


@pytest.mark.parametrize("grammar", [GrammarSpec("regex", r"a[^\s\S]"), GrammarSpec(
    "json_schema", '{"properties":{"a":{"pattern":"[^\\\\s\\\\S]","type":"string"}},"required":["a"],"type":"object"}')])
def test_grammar_with_a_dead_end(runner_and_tok, grammar):
    """The other way to "the grammar rejected the sampled token 0": an unsatisfiable part of
    a valid grammar. The mask allows "a" (or '{"a": "'), after which it allows nothing at all. Wanted: a
    finished response or a 400 naming the field, never an error finish (HTTP 500)."""
    runner, tok = runner_and_tok
    s = Scheduler(runner, SchedulerConfig(max_running_requests=4), tokenizer=tok)
    s.add_request("r", tok.encode("a"), SamplingParams(max_new_tokens=8, temperature=0.0, grammar=grammar))
    out = run_all(s)
    assert s.flush_cache()
    assert out["r"][1] == "invalid", out["r"]  # HTTP 400 naming the constraint, not an error (500)
