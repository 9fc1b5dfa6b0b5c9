"""Pooling requests in the scheduler (embeddings, reranking logits) on a tiny float32 Llama: the vector equals HF
transformers' (last token, mean, first token of the final hidden states; the last position's logits), alone,
batched with generating requests, prefilled in chunks, with overlap, with the prefix cache; aborts and the KV
accounting."""

from __future__ import annotations

import pytest
import torch

from model_executor.sampling_params import SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.io_struct import PoolingSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.test_scheduler import greedy, prompts

LAST, MEAN, CLS = PoolingSpec("last"), PoolingSpec("mean"), PoolingSpec("cls")


@pytest.fixture(scope="module")
def embed_runner(tiny_llama):
    return ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=16, max_total_tokens=2048,
                                    embedding_only=True))


@pytest.fixture(scope="module")
def lm_runner(tiny_llama):
    return ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=16, max_total_tokens=2048))


_last: dict[int, Scheduler] = {}


def scheduler(runner, **cfg) -> Scheduler:
    """A scheduler on a shared runner: the previous one's prefix cache gives its slots back first."""
    old = _last.get(id(runner))
    if old is not None and old.tree is not None:
        old.tree.flush()
    s = _last[id(runner)] = Scheduler(runner, SchedulerConfig(max_running_requests=16, **cfg))
    return s


def drain(s: Scheduler) -> dict[str, object]:
    """rid -> the pooled vector (numpy), or the token ids of a generating request."""
    out, tokens = {}, {}
    for _ in range(10_000):
        if not s.has_work():
            break
        for o in s.step():
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                out[o.rid] = o.embedding if o.embedding is not None else (tokens[o.rid], o.finish_reason.kind)
    assert not s.has_work()
    s.check_invariant()
    return out


@pytest.fixture(scope="module")
def hidden_ref(tiny_llama):
    """The final hidden states of a prompt, HF's backbone (AutoModel's last_hidden_state)."""
    _, hf = tiny_llama

    def ref(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf.model(torch.tensor([ids])).last_hidden_state[0]

    return ref


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float(a @ b / (a.norm() * b.norm()))


def expected(ref, ids, kind):
    h = ref(ids)
    return {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[kind]


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooled_vector_equals_hf_alone_and_chunked(embed_runner, hidden_ref, kind):
    ps = prompts(3, seed=5, lo=20, hi=90)
    for chunk in (None, 16):
        s = scheduler(embed_runner, chunked_prefill_size=chunk)
        for i, p in enumerate(ps):
            s.add_request(f"e{i}", p, SamplingParams(), PoolingSpec(kind))
        out = drain(s)
        for i, p in enumerate(ps):
            want = expected(hidden_ref, p, kind)
            got = torch.as_tensor(out[f"e{i}"])
            assert got.shape == want.shape
            torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)


def test_pooling_batched_with_generation_and_overlap(lm_runner, hidden_ref, tiny_llama):
    """A causal LM runner (a reranker's) pools too; generating requests in the same batches keep their tokens."""
    ps = prompts(6, seed=9, lo=10, hi=70)
    alone = scheduler(lm_runner, disable_radix_cache=True)
    alone.add_request("g", ps[0], greedy(6))
    want_tokens = drain(alone)["g"]
    for overlap, mixed in ((False, False), (True, True)):
        s = scheduler(lm_runner, enable_overlap=overlap, enable_mixed_chunk=mixed, chunked_prefill_size=24)
        s.add_request("g", ps[0], greedy(6))
        for i, p in enumerate(ps[1:]):
            s.add_request(f"e{i}", p, SamplingParams(), LAST if i % 2 else MEAN)
        out = drain(s)
        assert out["g"] == want_tokens
        for i, p in enumerate(ps[1:]):
            want = expected(hidden_ref, p, "last" if i % 2 else "mean")
            assert cosine(out[f"e{i}"], want) > 0.9999


def test_logits_pooling_equals_hf_last_position(lm_runner, tiny_llama):
    _, hf = tiny_llama
    p = prompts(1, seed=3, lo=30, hi=31)[0]
    s = scheduler(lm_runner, chunked_prefill_size=8)
    s.add_request("y", p, SamplingParams(), PoolingSpec("logits", (7, 11)))
    s.add_request("all", p, SamplingParams(), PoolingSpec("logits"))
    out = drain(s)
    with torch.no_grad():
        want = hf(torch.tensor([p])).logits[0, -1]
    torch.testing.assert_close(torch.as_tensor(out["y"]), want[[7, 11]], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.as_tensor(out["all"]), want, rtol=1e-4, atol=1e-4)


def test_prefix_cache_serves_last_token_pooling_not_mean(embed_runner, hidden_ref):
    p = prompts(1, seed=11, lo=40, hi=41)[0]
    s = scheduler(embed_runner)
    s.add_request("a", p, SamplingParams(), LAST)
    drain(s)
    s.add_request("b", p, SamplingParams(), LAST)
    s.add_request("c", p, SamplingParams(), MEAN)
    cached = {}
    for _ in range(100):
        if not s.has_work():
            break
        for o in s.step():
            if o.finish_reason is not None:
                cached[o.rid] = (o.cached_tokens, o.embedding)
    assert cached["b"][0] == len(p) - 1  # served from the cache up to the last token
    assert cached["c"][0] == 0  # mean pooling reads every row
    assert cosine(cached["b"][1], expected(hidden_ref, p, "last")) > 0.9999
    assert cosine(cached["c"][1], expected(hidden_ref, p, "mean")) > 0.9999


def test_abort_of_a_pooling_request_frees_its_kv(embed_runner):
    s = scheduler(embed_runner, chunked_prefill_size=8, disable_radix_cache=True)
    s.add_request("x", prompts(1, seed=2, lo=60, hi=61)[0], SamplingParams(), MEAN)
    s.step()  # one chunk in
    s.abort("x")
    out = [o for _ in range(5) for o in s.step()]
    assert [o.finish_reason.kind for o in out if o.rid == "x"] == ["abort"]
    assert not s.has_work()
    s.check_invariant()
    assert s.allocator.available_size() == s.allocator.num_slots
