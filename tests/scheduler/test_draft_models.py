"""STANDALONE and EAGLE3 drafts (scheduler/draft_model.py) through the Scheduler on tiny random float32 models:
greedy outputs equal plain decoding's token for token (stop ids, stop strings, max_tokens inside a run, penalties,
logprobs, two requests with one prompt), the draft pool's KV slots and rows all come back, a draft that is the
target itself has every draft accepted, the EAGLE-3 head's drafts equal a plain reference run of the head, and the
one-line errors."""

from __future__ import annotations

import pytest
import torch

from model_executor.model_config import ModelConfigError
from model_executor.sampling_params import SamplingParams
from scheduler.draft_model import DraftModelProposer, Eagle3Drafts
from scheduler.speculative import SpeculativeConfig
from tests.conftest import TINY_LLAMA, save_tiny_hf_model
from tests.models.test_eagle3 import eagle3_config, eagle3_tensors, reference_eagle3, save_eagle3
from tests.scheduler.test_speculative import make_scheduler, run_all, variant, workload

K = 4  # verified tokens per step: the last token and 3 drafts
TARGET = dict(TINY_LLAMA, num_hidden_layers=4)
EAGLE_LAYERS = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}


class CharTokenizer:
    """Token id t decodes to one letter: stop strings match inside runs of tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_models")
    save_tiny_hf_model(root / "target", TARGET, seed=3)
    save_tiny_hf_model(root / "small", dict(TINY_LLAMA, num_hidden_layers=1), seed=5)
    save_tiny_hf_model(root / "other_vocab", dict(TINY_LLAMA, num_hidden_layers=1, vocab_size=330), seed=5)
    cfg = eagle3_config(**EAGLE_LAYERS)
    weights = eagle3_tensors(cfg, seed=1)
    save_eagle3(root / "head", cfg, weights)
    return root, cfg, weights


def requests(n: int, reference: dict | None) -> list[tuple[str, list[int], SamplingParams]]:
    """variant()'s mix, plus stop strings by turns and each seventh prompt twice (n=2)."""
    reqs = []
    for i, prompt in enumerate(workload(n, seed=7)):
        out = reference[f"r{i}"][0] if reference else None
        params = variant(i, out)
        if i % 5 == 0 and out and len(out) > 6:  # a stop string that first ends at output token 5
            tail = CharTokenizer().decode(out[4:6])
            if tail not in CharTokenizer().decode(out[:5]):
                params = SamplingParams(max_new_tokens=params.max_new_tokens, temperature=0.0, ignore_eos=True,
                                        stop=(tail,))
        reqs.append((f"r{i}", prompt, params))
        if i % 7 == 0:
            reqs.append((f"r{i}b", prompt, params))
    return reqs


def scheduler(path, spec):
    s = make_scheduler(path, spec)
    s.tokenizer = CharTokenizer()
    return s


@pytest.fixture(scope="module")
def plain(models):
    root = models[0]
    first = run_all(scheduler(root / "target", None), requests(60, None))
    reqs = requests(60, first)
    return reqs, run_all(scheduler(root / "target", None), reqs)


def assert_drained(s) -> None:
    """Both pools back to empty: the target's (its radix cache aside) and the draft's."""
    s.check_invariant()
    assert s.num_held_slots() == s.tree.total_size()
    proposer = s.speculator.proposer
    assert isinstance(proposer, DraftModelProposer)
    draft = proposer.runner
    assert proposer.seqs == {}
    assert draft.allocator.available_size() == draft.allocator.num_slots
    assert draft.req_to_token_pool.available_size() == draft.req_to_token_pool.size


def spec_config(algorithm: str, path, **over) -> SpeculativeConfig:
    return SpeculativeConfig(algorithm, K, draft_model_path=str(path), adaptive=False, **over)


@pytest.mark.parametrize("draft", ["small", "target"])
def test_standalone_greedy_outputs_equal_plain_decoding(models, plain, draft):
    root = models[0]
    reqs, expected = plain
    s = scheduler(root / "target", spec_config("STANDALONE", root / draft))
    out = run_all(s, reqs)
    assert out.keys() == expected.keys() and len(out) > 60
    for rid in expected:
        assert out[rid][:2] == expected[rid][:2], rid
    kinds = [finish[0] for _, finish, _ in expected.values()]
    assert sum(m is not None and isinstance(m, str) for _, (_, m), _ in expected.values()) > 3  # stop strings hit
    assert "length" in kinds and "stop" in kinds
    stats = s.stats()
    assert stats["spec_verify_steps"] > 100
    assert_drained(s)
    if draft == "target":  # plain greedy requests: the target drafting for itself has every draft accepted
        greedy = [(rid, p, SamplingParams(max_new_tokens=25, temperature=0.0, ignore_eos=True))
                  for rid, p, _ in reqs[:20]]
        s = scheduler(root / "target", spec_config("STANDALONE", root / draft))
        run_all(s, greedy)
        stats = s.stats()
        assert stats["spec_accepted_tokens"] >= 0.98 * stats["spec_draft_tokens"] > 300
        assert stats["spec_accept_length"] > K - 0.5
        assert_drained(s)


def test_standalone_retraction_and_abort(models):
    root = models[0]
    reqs = [(f"r{i}", p, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(workload(24, seed=2))]
    alone = run_all(make_scheduler(root / "target", None), reqs)
    s = make_scheduler(root / "target", spec_config("STANDALONE", root / "small"), slots=700)
    out = run_all(s, reqs)
    assert s.num_retractions > 0
    assert {rid: v[0] for rid, v in out.items()} == {rid: v[0] for rid, v in alone.items()}
    assert_drained(s)
    s = make_scheduler(root / "target", spec_config("STANDALONE", root / "target"))
    for rid, p, params in reqs:
        s.add_request(rid, p, params)
    for _ in range(3):
        s.step()
    assert s.speculator.proposer.seqs  # drafting holds draft KV
    s.abort("r3")
    s.abort("r0")
    while s.has_work():
        s.step()
    assert_drained(s)


class RecordingEagle3(Eagle3Drafts):
    """Records each request's first proposal from an empty head: the target position of head row 0, the tokens
    the head rows take (position p + 1 for row p), the drafts, and the aux hidden states they came from."""

    def __init__(self, inner: Eagle3Drafts):
        super().__init__(inner.runner)
        self.first: dict[str, tuple[int, list[int], list[int], torch.Tensor]] = {}

    def propose(self, reqs, ks):
        pending = {r.rid: (self.seqs[r.rid].base, torch.cat(self.seqs[r.rid].pending)) for r in reqs
                   if r.rid not in self.first and r.rid in self.seqs and self.seqs[r.rid].length == 0}
        out = super().propose(reqs, ks)
        for r, d in zip(reqs, out):
            if r.rid in pending:
                base, aux = pending[r.rid]
                self.first[r.rid] = (base, (r.input_ids + r.output_ids)[base + 1:], d, aux)
        return out


def check_head_drafts(s, cfg, w) -> int:
    """Each recorded first proposal's two drafts against the plain reference run of the head: head row p takes
    token p + 1 and the target's states at p; the second step feeds the head's own output back. Returns how
    many were checked."""
    table = s.runner.model.model.embed_tokens.weight.detach()
    d2t = w["d2t"] + torch.arange(cfg["draft_vocab_size"])
    checked = 0
    for _, ids, drafts, aux in s.speculator.proposer.first.values():
        if len(drafts) < 2:
            continue
        assert len(aux) == len(ids)
        g = aux @ w["fc.weight"].T
        logits, hidden = reference_eagle3(w, cfg, table, ids, g)
        d1 = int(d2t[logits[-1].argmax()])
        logits, _ = reference_eagle3(w, cfg, table, ids + [d1], torch.cat([g, hidden[-1:]]))
        assert drafts[:2] == [d1, int(d2t[logits[-1].argmax()])]
        checked += 1
    return checked


def test_eagle3_greedy_outputs_equal_plain_decoding_and_drafts_equal_the_heads(models, plain):
    root, cfg, w = models
    reqs, expected = plain
    s = scheduler(root / "target", spec_config("EAGLE3", root / "head"))
    s.speculator.proposer = RecordingEagle3(s.speculator.proposer)
    out = run_all(s, reqs)
    for rid in expected:
        assert out[rid][:2] == expected[rid][:2], rid
    assert s.stats()["spec_verify_steps"] > 100
    assert_drained(s)
    assert check_head_drafts(s, cfg, w) > 20


def test_eagle3_retraction(models):
    root = models[0]
    reqs = [(f"r{i}", p, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(workload(24, seed=2))]
    alone = run_all(make_scheduler(root / "target", None), reqs)
    s = make_scheduler(root / "target", spec_config("EAGLE3", root / "head"), slots=700)
    out = run_all(s, reqs)
    assert s.num_retractions > 0
    assert {rid: v[0] for rid, v in out.items()} == {rid: v[0] for rid, v in alone.items()}
    assert_drained(s)


def test_draft_model_errors(models):
    root = models[0]
    with pytest.raises(ModelConfigError, match="vocab_size 330 is not the target's 320"):
        make_scheduler(root / "target", spec_config("STANDALONE", root / "other_vocab"))
    with pytest.raises(ModelConfigError, match="not an EAGLE-3 head"):
        make_scheduler(root / "target", spec_config("EAGLE3", root / "small"))
    with pytest.raises(ValueError, match="needs a draft model path"):
        SpeculativeConfig("STANDALONE", K)


def test_eagle3_chunked_prefill_and_mixed_chunks(models):
    """Prompts prefilled in chunks while others decode inside the extend batches: the head gets every prompt
    row in order (its first drafts come from the whole prompt) and the outputs equal plain decoding's."""
    root = models[0]
    prompts = workload(12, seed=4)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
    alone = run_all(make_scheduler(root / "target", None), reqs)
    s = make_scheduler(root / "target", spec_config("EAGLE3", root / "head"), enable_mixed_chunk=True,
                       chunked_prefill_size=8, disable_radix_cache=True)
    s.speculator.proposer = RecordingEagle3(s.speculator.proposer)
    tokens: dict[str, list[int]] = {}
    for rid, p, prm in reqs:
        s.add_request(rid, p, prm)
        for _ in range(2):
            for out in s.step():
                tokens.setdefault(out.rid, []).extend(out.new_token_ids)
    while s.has_work():
        for out in s.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
    assert tokens == {rid: v[0] for rid, v in alone.items()}
    first = s.speculator.proposer.first
    assert len(first) >= 4 and any(len(prompts[int(rid[1:])]) > 8 for rid in first)
    for rid, (base, ids, _, aux) in first.items():
        # from the first token: every row with target KV (the prompt's chunks, decode steps inside extend batches)
        assert base == 0 and len(aux) == len(ids), rid
    s.check_invariant()
    assert s.speculator.proposer.seqs == {}


def test_eagle3_keeps_the_newest_pending_rows(models, monkeypatch):
    """A request with more pending rows than the head keeps (here 6: every prompt here is longer) drafts from its
    newest ones, with the head's positions starting there; outputs unchanged, both pools drained."""
    from scheduler import draft_model

    monkeypatch.setattr(draft_model, "MAX_PENDING_ROWS", 6)
    root, cfg, w = models
    reqs = [(f"r{i}", p, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(workload(12, seed=5)) if len(p) > 6]
    alone = run_all(make_scheduler(root / "target", None), reqs)
    s = make_scheduler(root / "target", spec_config("EAGLE3", root / "head"))
    s.speculator.proposer = RecordingEagle3(s.speculator.proposer)
    out = run_all(s, reqs)
    assert {rid: v[0] for rid, v in out.items()} == {rid: v[0] for rid, v in alone.items()}
    assert_drained(s)
    assert all(base > 0 and len(aux) == 6 for base, _, _, aux in s.speculator.proposer.first.values())
    assert check_head_drafts(s, cfg, w) >= 4


def test_eagle3_after_a_radix_cache_hit(models):
    """A prompt the target takes from its radix cache has no hidden states: the head starts at the first token
    the target computes, and drafts from there as the reference does."""
    root, cfg, w = models
    prompts = workload(6, seed=6)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    s = make_scheduler(root / "target", spec_config("EAGLE3", root / "head"))
    s.speculator.proposer = RecordingEagle3(s.speculator.proposer)
    plain = make_scheduler(root / "target", None)
    for tag in ("a", "b"):  # the second round finds each prompt in the cache
        reqs = [(f"{tag}{i}", p, params) for i, p in enumerate(prompts)]
        assert run_all(s, reqs) == run_all(plain, reqs)
    first = s.speculator.proposer.first
    assert all(first[f"a{i}"][0] == 0 and first[f"b{i}"][0] == len(p) - 1 for i, p in enumerate(prompts))
    assert check_head_drafts(s, cfg, w) == 2 * len(prompts)
    assert_drained(s)


def test_start_up_checks_the_draft_against_the_target(models):
    """server/model_source.check_draft_model: one line naming the flag before anything loads."""
    from types import SimpleNamespace

    from model_executor.model_config import ModelConfig
    from server.model_source import ModelSourceError, check_draft_model

    root = models[0]
    target = ModelConfig.from_pretrained(root / "target")

    def check(algorithm, draft):
        args = SimpleNamespace(speculative_algorithm=algorithm, speculative_draft_model_path=str(root / draft),
                               download_dir=None)
        return check_draft_model(args, target)

    assert check("STANDALONE", "small") == {"speculative_draft_model_path": str(root / "small")}
    assert check("EAGLE3", "head")["speculative_draft_model_path"] == str(root / "head")
    for algorithm, draft, message in [("STANDALONE", "other_vocab", "vocab_size 330 is not the target's 320"),
                                      ("EAGLE3", "small", "not an EAGLE-3 head"),
                                      ("STANDALONE", "head", "EAGLE-3 draft head, not a model to serve")]:
        with pytest.raises(ModelSourceError, match=f"--speculative-draft-model-path: .*{message}") as e:
            check(algorithm, draft)
        assert "\n" not in str(e.value)


def test_a_failing_draft_model_costs_drafts_not_requests(models, monkeypatch):
    """The draft's forward raising now and then: those steps verify no drafts, the draft starts those requests
    over, outputs equal plain decoding's and both pools drain."""
    root = models[0]
    reqs = [(f"r{i}", p, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(workload(8, seed=8))]
    alone = run_all(make_scheduler(root / "target", None), reqs)
    s = make_scheduler(root / "target", spec_config("STANDALONE", root / "target"))
    draft = s.speculator.proposer.runner
    forward, calls = draft.forward, []

    def flaky(fb):
        calls.append(fb.mode)
        if len(calls) % 3 == 2:
            raise RuntimeError("injected")
        return forward(fb)

    monkeypatch.setattr(draft, "forward", flaky)
    out = run_all(s, reqs)
    assert {rid: v[0] for rid, v in out.items()} == {rid: v[0] for rid, v in alone.items()}
    assert len(calls) > 6 and s.stats()["spec_accepted_tokens"] > 0
    assert_drained(s)
