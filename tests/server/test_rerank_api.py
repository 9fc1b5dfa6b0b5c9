"""/v1/rerank and /v1/score on the real server (CPU) with a tiny random Qwen3 causal LM served as a
Qwen3-Reranker (--is-reranker): scores equal an HF transformers reference (Qwen3-Reranker's prompt, p("yes")
of the softmax over the "no" and "yes" logits at the last position); ordering, top_n, return_documents;
bad input is a 400 naming the field; the embedding and generation routes are refused."""

from __future__ import annotations

import httpx
import pytest
import torch

from server.serving_rerank import DEFAULT_INSTRUCTION, QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX
from tests.fake_scheduler import ServerProcess
from tests.pooling_models import fuzz_routes, save_tiny

QUERY = "the quick brown fox"
DOCS = ["the lazy dog sat on the mat", "hello world", "once upon a time there was a fox", "the cat"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("rerank") / "tiny-qwen3-reranker"
    hf = save_tiny(path, "causal", seed=11)
    return path, hf


@pytest.fixture(scope="module")
def server(folder):
    srv = ServerProcess("--is-reranker", "--chunked-prefill-size", "32", model_dir=folder[0],
                        fake=False).wait_healthy()
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]


@pytest.fixture(scope="module")
def reference(folder):
    """(query, document, instruction) -> p(yes), computed as Qwen3-Reranker's model card does."""
    from transformers import AutoTokenizer

    path, hf = folder
    tok = AutoTokenizer.from_pretrained(path)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    prefix = tok.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
    suffix = tok.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)

    def score(query: str, doc: str, instruction: str = DEFAULT_INSTRUCTION) -> float:
        body = tok(f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}", add_special_tokens=False)
        ids = prefix + body["input_ids"] + suffix
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1, [no, yes]]
        return float(torch.log_softmax(logits, dim=-1)[1].exp())

    return score


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_rerank_equals_the_reference_in_order(server, reference):
    r = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    want = [reference(QUERY, d) for d in DOCS]
    results = body["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for x in results:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-4)
        assert x["document"] == {"text": DOCS[x["index"]]}
    assert body["usage"]["total_tokens"] > 0
    r = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False,
                                    "instruction": "Find animals"})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    want = [reference(QUERY, d, "Find animals") for d in DOCS]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
    assert all("document" not in x for x in results)


def test_score_pairs_equal_the_reference(server, reference):
    r = post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(DOCS)))
    for d, doc in zip(data, DOCS):
        assert d["score"] == pytest.approx(reference(QUERY, doc), abs=1e-4)
    r = post(server, "/v1/score", {"text_1": ["hello", "a fox"], "text_2": ["world", "the dog"]})
    assert r.status_code == 200, r.text
    got = [d["score"] for d in r.json()["data"]]
    assert got == pytest.approx([reference("hello", "world"), reference("a fox", "the dog")], abs=1e-4)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["d"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": ["word " * 600]}, "documents"),  # above the 512-token context
    ("/v1/rerank", {"query": QUERY, "documents": ["d"], "rank_fields": ["x"]}, "rank_fields"),
    ("/v1/rerank", {"query": 5, "documents": ["d"]}, "query"),
    ("/v1/score", {"text_1": [], "text_2": "d"}, "text_1"),
    ("/v1/score", {"text_1": "q", "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": "q"}, "text_2"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param, r.text
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_other_routes_are_refused(server):
    for path, body in [("/v1/embeddings", {"input": "hi"}), ("/v1/completions", {"prompt": "hi"})]:
        r = post(server, path, body)
        assert r.status_code == 400, r.text
        assert "this server serves reranking" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 200


def test_fuzzed_bodies_never_break_the_server(server):
    seen = fuzz_routes(server.url, ["/v1/rerank", "/v1/score"])
    for path in ("/v1/rerank", "/v1/score"):
        assert 200 in seen[path] and 400 in seen[path], seen
    assert post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS}).status_code == 200
