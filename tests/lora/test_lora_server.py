"""Multi-LoRA through the real server (CPU, a tiny random Llama, PEFT adapters): adapters picked by `model`
(vLLM), "base:adapter" (SGLang) and `lora_path`, equal to PEFT's greedy output; /v1/models lists them with
their parent; unknown adapters are 404s in the API's error shape; load and unload over HTTP, a bad adapter a 400
while the server stays healthy; at --tp-size 2 (gloo ranks) too."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.fake_scheduler import ServerProcess, build_tiny_model_folder
from tests.lora_models import ADAPTERS, save_adapter

PROMPT = [5, 17, 42, 99, 123, 7, 250, 31]
NEW = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-server")
    base = build_tiny_model_folder(root / "tiny", with_weights=True)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    adapters = {n: (root / n, save_adapter(hf, root / n, seed=20 + i, **ADAPTERS[n])) for i, n in
                enumerate(("a1", "a2"))}
    return base, hf, adapters


@pytest.fixture(scope="module")
def server(models):
    base, _, adapters = models
    srv = ServerProcess("--lora-paths", f"a1={adapters['a1'][0]}", "--max-lora-rank", "8",
                        "--lora-target-modules", "all", "--max-loras-per-batch", "2", model_dir=base,
                        fake=False).wait_healthy()
    yield srv
    assert srv.stop() == 0


def reference(model) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(PROMPT):].tolist()


def complete(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, **body})


def tokens_of(server, r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def generate(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", timeout=60, json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        **body})


def test_models_lists_adapters_with_parent(server):
    data = httpx.get(f"{server.url}/v1/models").json()["data"]
    base = data[0]["id"]
    assert [(m["id"], m.get("parent")) for m in data[1:]] == [("a1", base)]


def test_adapter_picked_by_model_base_colon_name_and_lora_path(server, models):
    _, hf, adapters = models
    want = reference(adapters["a1"][1])
    base = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    assert generate(server, lora_path="a1").json()["output_ids"] == want
    assert generate(server).json()["output_ids"] == reference(hf)
    r = complete(server, model="a1")
    assert r.json()["model"] == "a1"
    assert tokens_of(server, r) == want
    assert tokens_of(server, complete(server, model=f"{base}:a1")) == want
    assert tokens_of(server, complete(server, model=base, lora_path="a1")) == want


@pytest.mark.parametrize("body", [{"model": "zz"}, {"lora_path": "zz"}, {"model": "base:zz"}])
def test_unknown_adapter_is_a_404_naming_it(server, body):
    if "model" in body and body["model"].startswith("base:"):
        base = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        body = {"model": f"{base}:zz"}
    r = complete(server, **body)
    assert r.status_code == 404
    assert "zz" in r.json()["error"]["message"]
    assert generate(server, lora_path="zz").status_code == 404


def test_load_use_unload_and_a_bad_adapter(server, models, tmp_path):
    _, _, adapters = models
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 64, "lora_alpha": 8, '
                                             '"target_modules": ["q_proj"]}')
    r = httpx.post(f"{server.url}/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "bad" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters["a2"][0])})
    assert r.status_code == 200, r.text
    assert generate(server, lora_path="a2").json()["output_ids"] == reference(adapters["a2"][1])
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 200, r.text
    assert complete(server, model="a2").status_code == 404
    assert httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 404
    assert generate(server, lora_path="a1").status_code == 200


CHAT = [{"role": "user", "content": "hello world"}]


def chat_text(server, **body) -> str:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": CHAT, "max_tokens": NEW, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def responses(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "input": CHAT[0]["content"], "max_output_tokens": NEW, "temperature": 0, **body})


def messages(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/messages", timeout=60, json={
        "messages": CHAT, "max_tokens": NEW, "temperature": 0, **body})


def responses_text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return "".join(part["text"] for item in r.json()["output"] if item["type"] == "message"
                   for part in item["content"])


def messages_text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return "".join(block["text"] for block in r.json()["content"] if block["type"] == "text")


def test_responses_and_messages_pick_adapters_like_chat(server):
    """The same prompt and sampling as chat: each route's text under an adapter is chat's under it."""
    base = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    want, plain = chat_text(server, model="a1"), chat_text(server)
    assert want != plain  # (the adapter changes this prompt's greedy tokens)
    for body in ({"lora_path": "a1"}, {"model": "a1"}, {"model": f"{base}:a1"}, {"model": base, "lora_path": "a1"}):
        r = responses(server, **body)
        assert responses_text(r) == want, body
        assert r.json()["model"] == body.get("lora_path") or body["model"]
        assert messages_text(messages(server, **{"model": base, **body})) == want, body
    assert responses_text(responses(server)) == plain
    assert messages_text(messages(server, model=base)) == plain


@pytest.mark.parametrize("body", [{"model": "zz"}, {"lora_path": "zz"}, {"model": "BASE:zz"}])
def test_unknown_adapter_on_responses_and_messages_is_a_404_in_their_shapes(server, body):
    base = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    body = {k: v.replace("BASE", base) for k, v in body.items()}
    r = responses(server, **body)
    assert r.status_code == 404, r.text
    assert "zz" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == ("lora_path" if "lora_path" in body else "model")
    r = messages(server, **{"model": base, **body})
    assert r.status_code == 404, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    assert "zz" in r.json()["error"]["message"]


def test_tp2_server_serves_adapters_loaded_at_start_and_over_http(models):
    """--tp-size 2 (two gloo ranks): each rank holds its shards; an adapter loaded over HTTP reaches both ranks
    (rank 0 relays the load) and gives PEFT's greedy tokens, beside the base model and a start-up adapter."""
    base, hf, adapters = models
    srv = ServerProcess("--tp-size", "2", "--lora-paths", f"a1={adapters['a1'][0]}", "--max-lora-rank", "8",
                        "--lora-target-modules", "all", model_dir=base, fake=False).wait_healthy()
    try:
        r = httpx.post(f"{srv.url}/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters["a2"][0])})
        assert r.status_code == 200, r.text
        for name, model in (("a2", adapters["a2"][1]), ("a1", adapters["a1"][1]), (None, hf)):
            body = {"lora_path": name} if name else {}
            assert generate(srv, **body).json()["output_ids"] == reference(model), name
        assert httpx.post(f"{srv.url}/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
        assert generate(srv, lora_path="a2").status_code == 404
        assert generate(srv, lora_path="a1").json()["output_ids"] == reference(adapters["a1"][1])
    finally:
        assert srv.stop() == 0
