"""/v1/embeddings on the real server (CPU) with a tiny random Qwen3 saved as a sentence-transformers model
(last-token pooling, Normalize), detected without a flag: embeddings equal HF transformers' (AutoModel's last
hidden state at the last token, L2-normalised) for strings, batches and token ids, with `dimensions` and
base64; bad input is a 400 naming the field; generation routes answer 400 in their API's error shape; a
generation server refuses /v1/embeddings naming --is-embedding."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.fake_scheduler import ServerProcess
from tests.pooling_models import fuzz_routes, save_tiny, write_sentence_transformers_files

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world", "once upon a time there was a model"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed") / "tiny-qwen3-embedding"
    save_tiny(path, "causal", seed=7)
    write_sentence_transformers_files(path, "lasttoken", normalize=True)
    return path


@pytest.fixture(scope="module")
def server(folder):
    # Small chunks: a long input is prefilled in several, pooled at the last.
    srv = ServerProcess("--chunked-prefill-size", "16", model_dir=folder, fake=False).wait_healthy()
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(folder):
    """ids -> HF's embedding (AutoModel, last token, L2-normalised)."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()

    def embed(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            h = hf(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(h, dim=0).numpy()

    return embed


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_strings_and_batches_equal_hf(client, reference, tokenizer):
    one = client.embeddings.create(model="x" if False else client.models.list().data[0].id, input=TEXTS[0])
    assert len(one.data) == 1 and one.data[0].index == 0
    ids0 = tokenizer.encode(TEXTS[0])
    assert one.usage.prompt_tokens == len(ids0) == one.usage.total_tokens
    assert cosine(one.data[0].embedding, reference(ids0)) >= 0.999
    assert np.linalg.norm(one.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
    batch = client.embeddings.create(model=one.model, input=TEXTS)
    assert [d.index for d in batch.data] == [0, 1, 2]
    for text, d in zip(TEXTS, batch.data):
        assert cosine(d.embedding, reference(tokenizer.encode(text))) >= 0.999
    assert batch.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)


def test_token_ids_long_inputs_and_dimensions(server, reference):
    ids = [5, 17, 42, 99, 123, 7, 250, 31]
    long_ids = [(i * 37) % 300 + 3 for i in range(200)]  # prefilled in chunks of 16
    r = post(server, "/v1/embeddings", {"input": [ids, long_ids]})
    assert r.status_code == 200, r.text
    got = [d["embedding"] for d in r.json()["data"]]
    assert cosine(got[0], reference(ids)) >= 0.999
    assert cosine(got[1], reference(long_ids)) >= 0.999
    r = post(server, "/v1/embeddings", {"input": ids, "dimensions": 16})
    assert r.status_code == 200, r.text
    vec = np.asarray(r.json()["data"][0]["embedding"])
    want = reference(ids)[:16]
    assert vec.shape == (16,)
    assert np.linalg.norm(vec) == pytest.approx(1.0, abs=1e-5)  # cut, then normalised again
    assert cosine(vec, want) >= 0.999


def test_base64_decodes_to_the_same_floats(server):
    body = {"input": TEXTS[1]}
    floats = post(server, "/v1/embeddings", body).json()["data"][0]["embedding"]
    r = post(server, "/v1/embeddings", {**body, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    decoded = np.frombuffer(raw, dtype="<f4")
    np.testing.assert_array_equal(decoded, np.asarray(floats, dtype=np.float32))


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [1, 2, 100000]}, "input"),
    ({"input": [5] * 600}, "input"),  # longer than the 512-token context
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 65}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "normalize": False}, "normalize"),
    ({"input": 3.5}, "input"),
    ({}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = post(server, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param, r.text
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_generation_routes_are_refused_in_their_api_shape(server):
    for path, body in [("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/generate", {"text": "hi"}),
                       ("/v1/rerank", {"query": "q", "documents": ["d"]}),
                       ("/v1/score", {"text_1": "q", "text_2": "d"})]:
        r = post(server, path, body)
        assert r.status_code == 400, (path, r.text)
        assert "this server serves embeddings" in r.json()["error"]["message"], r.text
    r = post(server, "/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and "embeddings" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 200
    info = httpx.get(f"{server.url}/get_model_info", timeout=10).json()
    assert info["is_generation"] is False


def test_a_generation_server_refuses_embeddings_naming_the_flag(default_server):
    r = httpx.post(f"{default_server.url}/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert r.status_code == 400
    assert "--is-embedding" in r.json()["error"]["message"]


def test_fuzzed_bodies_never_break_the_server(server):
    seen = fuzz_routes(server.url, ["/v1/embeddings"])
    assert 200 in seen["/v1/embeddings"] and 400 in seen["/v1/embeddings"], seen
    r = post(server, "/v1/embeddings", {"input": TEXTS[0]})
    assert r.status_code == 200, r.text
