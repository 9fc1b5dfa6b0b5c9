"""The real server end to end as the README's quick start runs it: no --model-path, the default model in its
default format (real scheduler, detokenizer, official openai client)."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from model_executor.default_model import default_quantization


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # the quick start's server (tests/conftest.py), shared with other modules


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def model_name(client) -> str:
    return client.models.list().data[0].id


def test_quick_start_answers_the_readme_question(server, client):
    """The README's curl example, asked of the quick-start server (chat, temperature 0, max_tokens 32)."""
    r = client.chat.completions.create(model=model_name(client), temperature=0, max_tokens=32,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 10
    info = httpx.get(f"{server.url}/server_info", timeout=10).json()["scheduler_info"]
    assert (info["quantization"] or "none") == default_quantization("cpu")  # the quick start's own format


def test_stream_equals_non_stream_and_prefix_cache(client):
    kw = {"model": model_name(client), "prompt": "The three primary colors are", "max_tokens": 20, "temperature": 0}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # The same prompt again is served from the radix cache.
    again = client.completions.create(**kw)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1  # all but the last
    assert again.choices[0].text == full.choices[0].text


def test_concurrent_requests_and_slots_return(server, client):
    name = model_name(client)

    def one(i: int) -> int:
        r = client.completions.create(model=name, prompt=f"Count to {i}:", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(32))) == [8] * 32
    info = httpx.get(f"{server.url}/server_info", timeout=10).json()
    stats = info["stats"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]
    assert info["scheduler_info"]["kv_cache_dtype"] == info["scheduler_info"]["dtype"]  # --kv-cache-dtype auto


def test_bad_request_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name(client), prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens" or "max_tokens" in str(e.value)


def test_server_info_has_the_startup_timeline(server):
    """/server_info's `startup`: the phases that ran on the way to ready (CPU: no graphs, no profile), each
    positive and together at most the total, which the ready line states with the largest phase."""
    startup = httpx.get(f"{server.url}/server_info", timeout=10).json()["startup"]
    total = startup.pop("total")
    assert list(startup) == ["launcher", "spawn", "imports", "weights", "tokenizer", "scheduler_setup",
                             "engine_setup", "http_start"]
    assert all(isinstance(s, float) and s > 0 for s in startup.values()), startup
    assert sum(startup.values()) <= total
    ready = next(line for line in server.output().splitlines() if line.startswith("duet ready:"))
    largest = max(startup, key=startup.get)
    assert f"startup={total:.1f}s ({largest} {startup[largest]:.1f}s" in ready, ready
