"""Speculative decoding through the Scheduler on tiny float32 models: greedy outputs equal plain decoding's
(stops, max_tokens, min_tokens, penalties, logit bias, logprobs), KV slots of rejected drafts come back and
the prefix cache holds only accepted tokens, retraction and abort, and sampled runs keep the target's joint
distribution of the first tokens."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from model_executor.sampler import Sampler, SamplingBatchInfo
from model_executor.sampling_params import SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.speculative import NgramProposer, SpeculativeConfig
from tests.conftest import TINY_LLAMA, save_tiny_hf_model

NGRAM = SpeculativeConfig("NGRAM", 4)


def make_scheduler(path, spec: SpeculativeConfig | None, *, slots=8192, max_running=64, **cfg) -> Scheduler:
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=max_running,
                                      max_total_tokens=slots))
    return Scheduler(runner, SchedulerConfig(max_running_requests=max_running, speculative=spec, **cfg))


def run_all(s: Scheduler, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, tuple]:
    for rid, prompt, params in reqs:
        s.add_request(rid, prompt, params)
    tokens, logprobs, finish = {}, {}, {}
    for _ in range(10_000):
        if not s.has_work():
            break
        for out in s.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            logprobs.setdefault(out.rid, []).extend(out.logprobs or [])
            if out.finish_reason is not None:
                finish[out.rid] = (out.finish_reason.kind, out.finish_reason.matched)
    assert not s.has_work(), "scheduler did not drain"
    s.check_invariant()
    return {rid: (tokens.get(rid, []), finish[rid], logprobs.get(rid, [])) for rid in finish}


def workload(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase (drafts hit) and random ones (they mostly miss)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(3, 320, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        out.append(phrase * int(torch.randint(1, 5, (1,), generator=g)) if i % 3 else phrase * 6)
    return out


def variant(i: int, plain_out: list[int] | None) -> SamplingParams:
    """Request i's parameters: greedy, with stops, penalties, bias, min_tokens or logprobs by turns."""
    base = {"max_new_tokens": 1 + (i * 7) % 23, "temperature": 0.0, "ignore_eos": True}
    kind = i % 6
    if kind == 1 and plain_out and len(plain_out) > 4:
        base["stop_token_ids"] = [plain_out[3]]  # stops inside a run
    elif kind == 2:
        base.update(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.5)
    elif kind == 3:
        base["logit_bias"] = ((7, 3.0), (11, -2.0))
    elif kind == 4:
        base.update(min_new_tokens=4, ignore_eos=False, stop_token_ids=[plain_out[0]] if plain_out else [])
    elif kind == 5:
        base["top_logprobs"] = 2
    return SamplingParams(**base)


class OracleDrafts(NgramProposer):
    """Drafts plain greedy decoding's own continuation: every draft hits, so stops, max_tokens and penalties
    land inside accepted runs."""

    def __init__(self, reference: dict[str, list[int]]):
        self.reference = reference

    def propose_one(self, req, k):
        n = len(req.output_ids)
        return self.reference[req.rid][n:n + k]


@pytest.fixture(scope="module")
def lossless_runs(tiny_llama):
    """240 requests run plainly, with NGRAM, and with oracle drafts (the same requests, one batch each)."""
    path, _ = tiny_llama
    prompts = workload(240)
    first = run_all(make_scheduler(path, None), [(f"r{i}", p, variant(i, None)) for i, p in enumerate(prompts)])
    reqs = [(f"r{i}", p, variant(i, first[f"r{i}"][0])) for i, p in enumerate(prompts)]
    plain = run_all(make_scheduler(path, None), reqs)
    ngram = make_scheduler(path, NGRAM)
    oracle = make_scheduler(path, SpeculativeConfig("NGRAM", 4, max_batch_drafts=4096))
    oracle.speculator.proposer = OracleDrafts({rid: v[0] for rid, v in plain.items()})
    return plain, {"ngram": (run_all(ngram, reqs), ngram), "oracle": (run_all(oracle, reqs), oracle)}


@pytest.mark.parametrize("drafts", ["ngram", "oracle"])
def test_greedy_outputs_equal_plain_decoding(lossless_runs, drafts):
    plain, runs = lossless_runs
    spec, s = runs[drafts]
    assert len(plain) == 240
    for rid in plain:
        assert spec[rid][0] == plain[rid][0], rid
        assert spec[rid][1] == plain[rid][1], rid
    stats = s.stats()
    # Speculation really ran: many verify steps, drafts accepted (the repeated phrases' for NGRAM).
    assert stats["spec_verify_steps"] > 200 and stats["spec_accepted_tokens"] > 300
    assert stats["spec_accept_length"] > (1.5 if drafts == "ngram" else 2.5)
    assert sum(kind == "stop" for _, (kind, _), _ in plain.values()) > 20  # the stop ids did stop requests


@pytest.mark.parametrize("drafts", ["ngram", "oracle"])
def test_logprobs_equal_plain_decodings(lossless_runs, drafts):
    plain, runs = lossless_runs
    spec = runs[drafts][0]
    compared = 0
    for rid, (tokens, _, lps) in plain.items():
        if not lps:
            continue
        other = spec[rid][2]
        assert [lp.token_id for lp in other] == [lp.token_id for lp in lps] == tokens
        for a, b in zip(lps, other):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            compared += 1
    assert compared > 100


class NeverDrafts(NgramProposer):
    """Drafts that are always wrong (one more than the token plain greedy decoding gives)."""

    def __init__(self, reference: dict[str, list[int]]):
        self.reference = reference

    def propose_one(self, req, k):
        ref = self.reference[req.rid]
        return [(t + 1) % 320 for t in ref[len(req.output_ids):len(req.output_ids) + k]]


def tree_paths(tree) -> list[list[int]]:
    paths, stack = [], [(tree.root, [])]
    while stack:
        node, prefix = stack.pop()
        key = prefix + node.key
        if not node.children:
            paths.append(key)
        stack.extend((child, key) for child in node.children.values())
    return paths


def test_rejected_drafts_free_their_slots_and_never_reach_the_prefix_cache(tiny_llama):
    prompts = workload(30, seed=1)
    reqs = [(f"r{i}", p, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    reference = run_all(make_scheduler(tiny_llama[0], None), reqs)
    s = make_scheduler(tiny_llama[0], SpeculativeConfig("NGRAM", 5, adaptive=False))
    s.speculator.proposer = NeverDrafts({rid: v[0] for rid, v in reference.items()})
    out = run_all(s, reqs)
    assert {rid: v[0] for rid, v in out.items()} == {rid: v[0] for rid, v in reference.items()}
    assert s.stats()["spec_draft_tokens"] > 200 and s.stats()["spec_accepted_tokens"] == 0
    assert s.num_held_slots() == s.tree.total_size()  # no request holds a slot
    assert s.allocator.available_size() + s.tree.total_size() == s.allocator.num_slots
    accepted = [p + toks[:-1] for (_, p, _), (toks, _, _) in zip(reqs, (out[r] for r, _, _ in reqs))]
    for path in tree_paths(s.tree):
        assert any(seq[:len(path)] == path for seq in accepted), "the cache holds a token no request accepted"


def test_retraction_and_abort_under_speculation(tiny_llama):
    path = tiny_llama[0]
    prompts = workload(24, seed=2)
    reqs = [(f"r{i}", p, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    alone = run_all(make_scheduler(path, None), reqs)
    s = make_scheduler(path, NGRAM, slots=700)  # too few for all at once: running requests get retracted
    out = run_all(s, reqs)
    assert s.num_retractions > 0
    assert {rid: v[0] for rid, v in out.items()} == {rid: v[0] for rid, v in alone.items()}

    s = make_scheduler(path, NGRAM)
    for rid, p, params in reqs:
        s.add_request(rid, p, params)
    for _ in range(4):
        s.step()
    s.abort("r3")
    s.abort("r0")
    while s.has_work():
        s.step()
    s.check_invariant()
    assert s.num_held_slots() == s.tree.total_size()


def test_mixed_chunks_and_arrivals_mid_run(tiny_llama):
    """Requests arriving while others speculate: with mixed chunks the running ones decode inside the extend
    batch (reading the last token a verify step left on the device) and speculate again after it."""
    path = tiny_llama[0]
    prompts = workload(12, seed=4)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    alone = run_all(make_scheduler(path, None), [(f"r{i}", p, params) for i, p in enumerate(prompts)])
    s = make_scheduler(path, NGRAM, enable_mixed_chunk=True)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        s.add_request(f"r{i}", p, params)
        for _ in range(2):
            for out in s.step():
                tokens.setdefault(out.rid, []).extend(out.new_token_ids)
    while s.has_work():
        for out in s.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
    s.check_invariant()
    assert tokens == {rid: v[0] for rid, v in alone.items()}
    assert s.stats()["spec_accepted_tokens"] > 0


# ---- the joint distribution of sampled tokens ------------------------------------------------------------

TEMP, TOP_P = 0.7, 0.9
PROMPT = [5, 9, 17, 33]


@pytest.fixture(scope="module")
def peaked_llama(tmp_path_factory):
    """A tiny Llama whose next-token distributions are peaked (a scaled LM head), so drafts often hit."""
    path = tmp_path_factory.mktemp("peaked_llama")
    model = save_tiny_hf_model(path, TINY_LLAMA, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def processed_probs(model, seqs: list[list[int]]) -> torch.Tensor:
    """The sampler's distribution (temperature, top_p) of the token after each sequence, by HF's model."""
    with torch.no_grad():
        logits = torch.stack([model(torch.tensor([s])).logits[0, -1] for s in seqs])
    params = [SamplingParams(temperature=TEMP, top_p=TOP_P)] * len(seqs)
    info = SamplingBatchInfo.from_params(params, [0] * len(seqs), "cpu")
    return torch.softmax(Sampler().filtered_logits(logits, info), dim=-1)


def exact_joint(model) -> dict[tuple[int, int, int], float]:
    joint = {}
    p1 = processed_probs(model, [PROMPT])[0]
    firsts = p1.nonzero().flatten().tolist()
    p2s = processed_probs(model, [PROMPT + [a] for a in firsts])
    for a, p2 in zip(firsts, p2s):
        seconds = p2.nonzero().flatten().tolist()
        p3s = processed_probs(model, [PROMPT + [a, b] for b in seconds])
        for b, p3 in zip(seconds, p3s):
            for c in p3.nonzero().flatten().tolist():
                joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return joint


class ForcedDrafts(NgramProposer):
    """Drafts the most likely continuation of the prompt, whatever was sampled so far (it hits often)."""

    def __init__(self, continuation: list[int]):
        self.continuation = continuation

    def propose_one(self, req, k):
        n = len(req.output_ids)
        return self.continuation[n:n + k]


def test_sampling_with_speculation_keeps_the_joint_distribution_of_the_first_three_tokens(peaked_llama):
    path, model = peaked_llama
    joint = exact_joint(model)
    best = max(joint, key=joint.get)
    torch.manual_seed(0)
    n = 20_000
    config = SpeculativeConfig("NGRAM", 3, adaptive=False, max_batch_drafts=4096, max_batch_size=4096)
    s = make_scheduler(path, config, slots=16384, max_running=1024)
    s.speculator.proposer = ForcedDrafts(list(best))
    params = SamplingParams(max_new_tokens=4, temperature=TEMP, top_p=TOP_P, ignore_eos=True)
    out = run_all(s, [(f"s{i}", PROMPT, params) for i in range(n)])
    stats = s.stats()
    assert stats["spec_verify_steps"] > n // 2 and stats["spec_accepted_tokens"] > n // 4
    counts: dict[tuple, int] = {}
    for tokens, _, _ in out.values():
        counts[tuple(tokens[:3])] = counts.get(tuple(tokens[:3]), 0) + 1
    assert set(counts) <= set(joint)  # nothing outside the filtered support
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * n >= 5]
    rest = [c for c in cells if joint[c] * n < 5]
    observed = [counts.get(c, 0) for c in big]
    expected = [joint[c] * n for c in big]
    if sum(joint[c] for c in rest) * n >= 5:
        observed.append(sum(counts.get(c, 0) for c in rest))
        expected.append(sum(joint[c] for c in rest) * n)
    assert len(big) >= 10
    total = sum(expected)
    assert chisquare(observed, [e * n / total for e in expected]).pvalue > 0.01
