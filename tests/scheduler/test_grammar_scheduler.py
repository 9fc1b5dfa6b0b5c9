"""The scheduler's grammar path (scheduler/grammar.py) on the default model, in process: constrained and
unconstrained requests batched together equal each alone (greedy), the grammar's end ends the request
(even with ignore_eos), a grammar that cannot compile fails only its request, and an abort in the grammar
queue frees it."""

from __future__ import annotations

import json
import re

import pytest

from model_executor.sampling_params import GrammarSpec, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.test_scheduler import make_scheduler, run_all

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"]}
REGEX = r"(yes|no), [0-9]{2}"


@pytest.fixture(scope="module")
def setup(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return model_dir, tok


def requests(tok):
    def chat(text):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    return {
        "schema": (chat("Reply in JSON."), SamplingParams(max_new_tokens=40, **greedy,
                   grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))),
        "regex": (chat("Is water wet?"), SamplingParams(max_new_tokens=12, **greedy, grammar=GrammarSpec("regex", REGEX))),
        "plain": (chat("Is water wet?"), SamplingParams(max_new_tokens=8, **greedy)),
        "plain2": (tok.encode("Once upon a time"), SamplingParams(max_new_tokens=6, **greedy)),
    }


def test_mixed_batch_equals_each_alone(setup):
    path, tok = setup
    reqs = requests(tok)
    s = make_scheduler(path, tokenizer=tok, slots=2048, disable_radix_cache=True)
    alone = {}
    for rid, (ids, params) in reqs.items():
        s.add_request(rid, ids, params)
        alone[rid] = run_all(s)[rid]
    for rid, (ids, params) in reqs.items():
        s.add_request(rid, ids, params)
    together = run_all(s)
    assert together == alone
    text = {rid: tok.decode(ids, skip_special_tokens=True) for rid, (ids, _) in alone.items()}
    # The grammar's end finished them (ignore_eos is set, and max_new_tokens was not reached).
    assert alone["schema"][1] == alone["regex"][1] == "stop"
    json.loads(text["schema"])
    assert re.fullmatch(REGEX, text["regex"]), text["regex"]
    assert alone["plain"][1] == "length"


def test_bad_grammar_fails_alone_and_abort_in_the_queue(setup):
    path, tok = setup
    s = make_scheduler(path, tokenizer=tok, slots=2048)
    s.add_request("bad", [1, 2, 3], SamplingParams(max_new_tokens=4, grammar=GrammarSpec("ebnf", "root ::= (")))
    s.add_request("ok", [1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
    out = run_all(s)
    assert out["bad"][1] == "error" and out["ok"] == (out["ok"][0], "length") and len(out["ok"][0]) == 3
    s.add_request("queued", [1, 2, 3], SamplingParams(max_new_tokens=4, grammar=GrammarSpec("regex", "[a-z]{3}x")))
    assert len(s.grammars) == 1 and s.has_work()
    s.abort("queued")
    assert len(s.grammars) == 0
    outs = s.step()
    assert [(o.rid, o.finish_reason.kind) for o in outs] == [("queued", "abort")]
    assert not s.has_work()
    s.check_invariant()


def test_grammar_that_must_end_overrides_min_tokens(setup):
    """min_tokens bans EOS, but a complete grammar allows only EOS: the grammar has the final say and the
    request stops there (before, every token was masked, token 0 came out and the grammar rejected it)."""
    path, tok = setup
    s = make_scheduler(path, tokenizer=tok, slots=2048, disable_radix_cache=True)
    s.add_request("r", tok.encode("Is water wet?"), SamplingParams(max_new_tokens=30, temperature=0.0,
                  min_new_tokens=20, grammar=GrammarSpec("regex", "(yes|no)")))
    ids, reason = run_all(s)["r"]
    assert reason == "stop"
    assert re.fullmatch("(yes|no)", tok.decode(ids, skip_special_tokens=True))


def test_min_tokens_still_bans_eos_while_the_grammar_allows_more(setup):
    """While the grammar accepts other tokens, min_tokens keeps EOS out: the output reaches min_tokens."""
    path, tok = setup
    s = make_scheduler(path, tokenizer=tok, slots=2048, disable_radix_cache=True)
    # Unconstrained by min_tokens this is "yes" then EOS (2 tokens).
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Is water wet? Answer yes or no."}],
                                                add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    s.add_request("r", prompt, SamplingParams(max_new_tokens=30, temperature=0.0, min_new_tokens=8,
                                              grammar=GrammarSpec("regex", "(yes|no)[ .!]{0,20}")))
    ids, reason = run_all(s)["r"]
    assert len(ids) >= 8 and reason in ("stop", "length")


def test_overlap_gives_the_same_constrained_outputs(setup):
    """With overlap a constrained batch's mask needs the token still in flight: the scheduler reads it after
    launching the next forward pass and before sampling it (scheduler._sample). Same tokens and finish reasons
    as without overlap, for constrained and unconstrained requests batched together."""
    path, tok = setup
    outs = {}
    for overlap in (False, True):
        s = make_scheduler(path, tokenizer=tok, slots=2048, disable_radix_cache=True, enable_overlap=overlap)
        for rid, (ids, params) in requests(tok).items():
            s.add_request(rid, ids, params)
        outs[overlap] = run_all(s)
        s.check_invariant()
    assert outs[True] == outs[False]
    assert outs[True]["schema"][1] == outs[True]["regex"][1] == "stop"



def test_penalized_request_stopping_in_the_read_inside_sample(setup, caplog):
    """With overlap a constrained batch reads the batch in flight inside _sample; a penalized request that stops
    in that read (on its first token, forced by a logit bias onto a stop token) is still in the batch being
    sampled. Its released row must not break that batch's penalties (the batch then failed and ran again one
    request at a time, leaking a KV slot): same outputs as without overlap, no failed batch, no leak."""
    import logging

    path, tok = setup
    ids, regex = requests(tok)["regex"]
    forced = 42
    pen = SamplingParams(max_new_tokens=4, temperature=0.0, frequency_penalty=0.5, logit_bias=((forced, 100.0),),
                         stop_token_ids=(forced,))
    outs = {}
    runner = make_scheduler(path, slots=2048).runner  # one model for both runs (each drains it)
    for overlap in (False, True):
        s = Scheduler(runner, SchedulerConfig(max_running_requests=16, disable_radix_cache=True,
                                              enable_overlap=overlap), tokenizer=tok)
        s.add_request("regex", ids, regex)
        for req in s.grammars.queue:  # compiled before the first step: both requests share every batch
            req.grammar_future.result()
        s.add_request("pen", ids, pen)
        with caplog.at_level(logging.WARNING, logger="duet.scheduler"):
            outs[overlap] = run_all(s)
        s.check_invariant()
    assert outs[True] == outs[False]
    assert outs[True]["pen"] == ([forced], "stop")
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
