"""The OpenAI-compatible and native API of a live server (real processes; the official openai client).

The scheduler is tests/fake_scheduler.py unless DUET_TEST_REAL_SCHEDULER=1.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import httpx
import openai
import pytest

from server.detokenizer import load_tokenizer
from server.protocol import ChatCompletionChunk, ChatCompletionResponse, CompletionChunk, CompletionResponse
from tests.fake_scheduler import ServerProcess, child_pids, use_real_scheduler


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess().wait_healthy()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(server):
    return load_tokenizer(str(server.model_dir))


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def sse_events(resp: httpx.Response) -> list:
    """Parse an SSE body strictly: `data: ...` events separated by blank lines, ending with [DONE]."""
    body = resp.text
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [json.loads(e[6:]) for e in events[:-1]]


def stream_text(client, model, **kw) -> tuple[list[str], list]:
    texts, chunks = {}, []
    for chunk in client.completions.create(model=model, stream=True, **kw):
        chunks.append(chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    return [texts[i] for i in sorted(texts)], chunks


def chat_stream_text(client, model, **kw) -> tuple[list[str], list]:
    texts, chunks = {}, []
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        chunks.append(chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return [texts[i] for i in sorted(texts)], chunks


def pick_stop(text: str) -> str:
    """A short stop string from the middle of text (its first occurrence is what the server cuts at)."""
    for start in range(len(text) // 3, len(text) - 2):
        cand = text[start:start + 2]
        if cand.strip() and "\ufffd" not in cand:
            return cand
    pytest.skip(f"no usable stop string in {text!r}")


# ---- models ---------------------------------------------------------------------------------------


def test_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.model_dir.name]
    assert client.models.retrieve(models[0].id).id == models[0].id
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["type"] == "NotFoundError" and e.value.body["code"] == 404


# ---- completions ------------------------------------------------------------------------------------


def test_completion_usage_and_length(client, model, tokenizer):
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens - 1  # not sent before
    assert r.choices[0].text
    again = client.completions.create(model=model, prompt=prompt, max_tokens=7, temperature=0,
                                      extra_body={"ignore_eos": True})
    # All but the last prompt token come from the prefix cache (the last one is run to get logits).
    assert again.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    assert again.choices[0].text == r.choices[0].text


def test_completion_default_max_tokens_is_16(client, model):
    r = client.completions.create(model=model, prompt="Count with me:", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


@pytest.mark.parametrize("prompt", ["Tell me a story about a fox", "[unicode] mixed scripts please"])
def test_stream_equals_non_stream_completions(client, model, prompt):
    kw = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(model=model, **kw).choices[0].text
    texts, chunks = stream_text(client, model, **kw)
    assert texts == [full]
    if not use_real_scheduler():  # (a random test model may emit invalid UTF-8 for real)
        assert "\ufffd" not in full.rstrip("\ufffd")  # only a character cut by max_tokens
    assert sum(1 for ch in chunks for c in ch.choices if c.finish_reason) == 1


def test_stream_equals_non_stream_chat(client, model):
    kw = {"messages": [{"role": "user", "content": "[unicode] hello"}], "max_tokens": 20, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    full = client.chat.completions.create(model=model, **kw).choices[0].message.content
    texts, _chunks = chat_stream_text(client, model, **kw)
    assert texts == [full]


def test_stop_string(client, model):
    kw = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(model=model, **kw).choices[0].text
    stop = pick_stop(full)
    expected = full[:full.index(stop)]
    r = client.completions.create(model=model, stop=stop, **kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    texts, _ = stream_text(client, model, stop=[stop, "zzzz-never"], **kw)
    assert texts == [expected]
    chat_kw = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 12, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    chat_full = client.chat.completions.create(model=model, **chat_kw).choices[0].message.content
    stop = pick_stop(chat_full)
    r = client.chat.completions.create(model=model, stop=[stop], **chat_kw)
    assert r.choices[0].message.content == chat_full[:chat_full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    texts, _ = chat_stream_text(client, model, stop=[stop], **chat_kw)
    assert texts == [r.choices[0].message.content]


def test_stop_token_ids_and_generate(server, tokenizer):
    body = {"text": "Alpha beta", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=30).json()
    ids = r["output_ids"]
    assert len(ids) == 8 and r["meta_info"]["completion_tokens"] == 8
    assert r["meta_info"]["finish_reason"]["type"] == "length"
    assert r["meta_info"]["prompt_tokens"] == len(tokenizer.encode("Alpha beta"))
    assert r["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    k = next((k for k in range(2, len(ids)) if ids[k] not in ids[:k]), None)
    if k is None:
        pytest.skip(f"no token in {ids} occurs first after position 2")
    stop_id = ids[k]
    body["sampling_params"]["stop_token_ids"] = [stop_id]
    r2 = httpx.post(f"{server.url}/generate", json=body, timeout=30).json()
    assert r2["output_ids"] == ids[:k + 1]
    assert r2["text"] == tokenizer.decode(ids[:k], skip_special_tokens=True)  # the stop token's text is left out
    assert r2["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    # The native stream sends the cumulative text, like SGLang.
    body["stream"] = True
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=30) as resp:
        resp.read()
        events = sse_events(resp)
    assert events[-1]["text"] == r2["text"] and events[-1]["output_ids"] == r2["output_ids"]
    assert all(b["text"].startswith(a["text"]) for a, b in itertools.pairwise(events))


@pytest.mark.skipif(use_real_scheduler(), reason="[eos N] is a fake-scheduler prompt trick")
def test_eos_ignore_eos_and_chat_default_max_tokens(client, model):
    r = client.completions.create(model=model, prompt="[eos 3] go", max_tokens=10, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4
    r = client.completions.create(model=model, prompt="[eos 3] go", max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    # Chat without max_tokens runs to the context limit; here EOS ends it first.
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "[eos 5] hi"}])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 6


def test_n_and_seed(client, model):
    kw = {"prompt": "Pick some words", "max_tokens": 10, "temperature": 1.0, "seed": 1234, "n": 3,
          "extra_body": {"ignore_eos": True}}
    a = client.completions.create(model=model, **kw)
    b = client.completions.create(model=model, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # reproducible
    assert len({c.text for c in a.choices}) == 3  # seed + i per choice
    assert a.usage.completion_tokens == 30
    assert a.usage.prompt_tokens == b.usage.prompt_tokens  # the prompt counts once
    texts, chunks = stream_text(client, model, **kw)
    assert texts == [c.text for c in a.choices]
    finishes = [(c.index, c.finish_reason) for ch in chunks for c in ch.choices if c.finish_reason]
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]
    greedy = client.completions.create(model=model, prompt="Pick some words", max_tokens=6, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text


def test_responses_match_the_protocol_models(server, model):
    body = {"model": model, "prompt": "shape", "max_tokens": 3, "logprobs": 2}
    CompletionResponse.model_validate(httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json())
    for event in sse_events(httpx.post(f"{server.url}/v1/completions", json=dict(body, stream=True), timeout=30)):
        CompletionChunk.model_validate(event)
    body = {"model": model, "messages": [{"role": "user", "content": "shape"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2}
    ChatCompletionResponse.model_validate(
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).json())
    body["stream"], body["stream_options"] = True, {"include_usage": True}
    for event in sse_events(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)):
        ChatCompletionChunk.model_validate(event)


def test_chat_stream_shape(server, model):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    for i in range(2):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert mine[0]["delta"].get("role") == "assistant"
        assert sum(1 for c in mine if c["finish_reason"]) == 1
        assert mine[-1]["finish_reason"] == "length"
        assert all(c["delta"].get("role") is None for c in mine[1:])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    assert all(e["usage"] is None for e in events[:-1])


def test_completion_stream_usage_chunk(server, model):
    body = {"model": model, "prompt": "Streamed usage, reported once at the end", "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    usages = []
    for _ in range(2):
        events = sse_events(httpx.post(f"{server.url}/v1/completions", json=body, timeout=30))
        assert events[-1]["choices"] == []
        assert all(e["usage"] is None for e in events[:-1])
        usages.append(events[-1]["usage"])
    assert [u["completion_tokens"] for u in usages] == [5, 5]
    prompt_tokens = usages[0]["prompt_tokens"]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] < prompt_tokens - 1  # not sent before
    assert usages[1]["prompt_tokens_details"] == {"cached_tokens": prompt_tokens - 1}  # the repeat hits


def test_completion_logprobs(client, model):
    r = client.completions.create(model=model, prompt="Logprobs please", max_tokens=5, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(t) <= 4 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    if "\ufffd" not in r.choices[0].text:
        assert "".join(lp.tokens) == r.choices[0].text
    streamed = [c.logprobs for ch in client.completions.create(
        model=model, prompt="Logprobs please", max_tokens=5, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) for c in ch.choices if c.logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert isinstance(t.token, str) and t.logprob <= 0 and isinstance(t.bytes, list)
        assert len(t.top_logprobs) == 2
        assert all(a.logprob >= b.logprob for a, b in zip(t.top_logprobs, t.top_logprobs[1:]))
    assert bytes(b for t in content for b in t.bytes).decode(errors="replace") == r.choices[0].message.content
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].logprobs is None


def test_echo_token_prompts_and_batches(client, model, tokenizer):
    r = client.completions.create(model=model, prompt="Echo this", max_tokens=3, echo=True, temperature=0)
    assert r.choices[0].text.startswith("Echo this") and len(r.choices[0].text) > len("Echo this")
    ids = tokenizer.encode("Echo this")
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0)
    by_text = client.completions.create(model=model, prompt="Echo this", max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=model, prompt=["first prompt", "second one"], max_tokens=3, n=2,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text and batch.choices[2].text == batch.choices[3].text
    assert batch.usage.prompt_tokens == len(tokenizer.encode("first prompt")) + len(tokenizer.encode("second one"))
    by_id_batch = client.completions.create(model=model, prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert by_id_batch.choices[0].text == by_text.choices[0].text and len(by_id_batch.choices) == 2
    r = client.completions.create(model=model, prompt="Zero", max_tokens=0)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0


def test_prefix_cache_reported(client, model):
    prompt = "A shared prefix that is long enough to be cached by the server " * 4
    client.completions.create(model=model, prompt=prompt, max_tokens=2)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=2)
    assert 0 < r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens


def test_concurrent_requests(server, model):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)

        async def one(i):
            if i % 2:
                r = await aclient.completions.create(model=model, prompt=f"request number {i}", max_tokens=12,
                                                     temperature=0, extra_body={"ignore_eos": True})
                return r.usage.completion_tokens, r.choices[0].text
            texts = []
            async for ch in await aclient.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=12,
                    stream=True, extra_body={"ignore_eos": True}):
                texts.extend(c.delta.content or "" for c in ch.choices)
            return 12, "".join(texts)

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert [n for n, _ in results] == [12] * 32
    assert all(text for _, text in results)


def test_server_info_metrics_and_flush(server, model, client):
    client.completions.create(model=model, prompt="metrics", max_tokens=3)
    info = httpx.get(f"{server.url}/server_info", timeout=10).json()
    assert info["args"]["port"] == server.port and info["args"]["device"] == "cpu"
    assert info["args"]["model_path"] == str(server.model_dir)
    stats = info["stats"]
    assert info["scheduler_info"]["num_kv_slots"] == stats["kv_total"] and "cuda_graph_bs" in info["scheduler_info"]
    assert {info["scheduler_pid"], info["detokenizer_pid"]} <= set(child_pids(server.proc.pid))
    for key in ("num_running", "num_waiting", "kv_total", "kv_free", "kv_cached", "kv_used", "cache_hit_rate",
                "path_counts", "num_finished"):
        assert key in stats
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in ("duet_requests_total", "duet_prompt_tokens_total", "duet_generation_tokens_total",
                 "duet_time_to_first_token_seconds_bucket", "duet_inter_token_latency_seconds_bucket",
                 "duet_e2e_request_latency_seconds_bucket", "duet_num_running_reqs", "duet_num_waiting_reqs",
                 "duet_kv_cache_usage", "duet_cache_hit_rate", 'duet_forward_passes_total{path="decode_graph"}',
                 'duet_forward_passes_total{path="extend_eager"}'):
        assert name in text, name
    assert 'duet_requests_total{finish_reason="length"}' in text
    for method in ("POST", "GET"):
        r = httpx.request(method, f"{server.url}/flush_cache", timeout=10)
        assert r.status_code == 200 and r.json()["success"] is True


def test_client_disconnect_frees_the_request(server, model, client):
    max_len = client.models.list().data[0].model_extra["max_model_len"]
    body = {"model": model, "prompt": "A very long story", "max_tokens": min(3000, max_len - 20), "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break
    # Non-streaming too: the client gives up after a short timeout.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=dict(body, stream=False), timeout=0.5)
    deadline = time.monotonic() + 10
    while True:
        info = httpx.get(f"{server.url}/server_info", timeout=10).json()
        s = info["stats"]
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_used"] == 0 \
                and info["num_inflight_requests"] == 0:
            break
        assert time.monotonic() < deadline, f"requests still held after the disconnect: {info}"
        time.sleep(0.1)
    assert s["kv_free"] + s["kv_cached"] == s["kv_total"]
    r = client.completions.create(model=model, prompt="still alive?", max_tokens=3)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_a_client_gone_before_a_streams_first_chunk_has_its_request_aborted():
    """A streamed request's 200 waits for its first chunk (serving_common.start_stream). A client that leaves
    meanwhile (its request queued behind one that holds the KV cache) has it aborted then, not when it would
    have started."""
    if use_real_scheduler():
        pytest.skip("the fake scheduler's KV budget and step time make the queueing deterministic")
    srv = ServerProcess("--max-total-tokens", "595", env={"DUET_FAKE_STEP_S": "0.05"}).wait_healthy()
    try:
        hold = {"prompt": "hold", "max_tokens": 500, "stream": True, "ignore_eos": True}  # 25 s of steps
        queued = {"prompt": "queued", "max_tokens": 590, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=hold, timeout=60) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            for _ in range(20):  # ten tokens: with its prompt it holds more of the cache than "queued" may leave
                next(lines)
            # No status line while it waits for a first token: the client gives up.
            with pytest.raises(httpx.ReadTimeout), httpx.stream(
                    "POST", f"{srv.url}/v1/completions", json=queued, timeout=httpx.Timeout(10, read=1.0)):
                pass
            deadline = time.monotonic() + 10
            while True:
                info = httpx.get(f"{srv.url}/server_info", timeout=10).json()
                if info["num_inflight_requests"] == 1 and info["stats"]["num_waiting"] == 0:
                    break
                assert time.monotonic() < deadline, \
                    f"the queued request was not aborted: {info['num_inflight_requests']} in flight, {info['stats']}"
                time.sleep(0.1)
            assert info["stats"]["num_running"] == 1
    finally:
        assert srv.stop() == 0


def test_explicit_nulls_mean_defaults(server, model):
    body = {"model": model, "prompt": "nulls", "n": None, "stream": None, "max_tokens": None, "temperature": None,
            "top_p": None, "stop": None, "seed": None, "logprobs": None, "echo": None, "ignore_eos": True,
            "user": "someone"}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                                         {"role": "user", "content": [{"type": "text", "text": "again"}]}],
            "max_tokens": 3, "logprobs": None, "n": None, "stream_options": None}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


# ---- peer routes, fields clients send, tools with no flags --------------------------------------------


def test_peer_route_aliases(server, model):
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, timeout=10).json()
    assert httpx.post(f"{server.url}/v1/tokenize", json={"prompt": "Hello world"}, timeout=10).json() == tok
    detok = httpx.post(f"{server.url}/v1/detokenize", json={"tokens": tok["tokens"]}, timeout=10).json()
    assert detok == httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}, timeout=10).json()
    assert detok["prompt"] == detok["text"] and detok["text"].endswith("Hello world")  # vLLM's and SGLang's keys
    assert httpx.get(f"{server.url}/version", timeout=10).json() == {"version": "0.1.0"}
    info = httpx.get(f"{server.url}/get_model_info", timeout=10).json()
    assert info["model_path"] == str(server.model_dir) and info["is_generation"] is True
    assert info["served_model_name"] == model
    before = httpx.get(f"{server.url}/server_info", timeout=10).json()["stats"]["num_finished"]
    r = httpx.get(f"{server.url}/health_generate", timeout=30)
    assert r.status_code == 200, r.text
    # It went through the engine: one more finished request.
    assert httpx.get(f"{server.url}/server_info", timeout=10).json()["stats"]["num_finished"] == before + 1


def test_skip_special_tokens_and_spaces_between_them(server, model, tokenizer):
    """A logit bias of +100 forces a special token; the text leaves it out unless skip_special_tokens is false
    (SGLang's sampling_params take the same field)."""
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    base = {"model": model, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {str(special): 100}}
    chat = dict(base, messages=[{"role": "user", "content": "hi"}])

    def chat_text(**kw) -> str:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=dict(chat, **kw), timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    assert chat_text() == chat_text(skip_special_tokens=True) == ""
    assert chat_text(skip_special_tokens=False) == "<|im_start|>" * 3
    assert chat_text(skip_special_tokens=False, spaces_between_special_tokens=True) == " ".join(["<|im_start|>"] * 3)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                      json=dict(chat, skip_special_tokens=False, stream=True)) as resp:
        resp.read()
        events = sse_events(resp)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "<|im_start|>" * 3
    r = httpx.post(f"{server.url}/v1/completions", json=dict(base, prompt="hi", skip_special_tokens=False), timeout=30)
    assert r.json()["choices"][0]["text"] == "<|im_start|>" * 3
    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True,
                                             "logit_bias": {str(special): 100}, "skip_special_tokens": False}}
    assert httpx.post(f"{server.url}/generate", json=gen, timeout=30).json()["text"] == "<|im_start|>" * 2


def test_include_stop_str_in_output(client, model, server, tokenizer):
    kw = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(model=model, **kw).choices[0].text
    stop = pick_stop(full)
    kept = full[:full.index(stop) + len(stop)]
    keep = dict(kw, extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    r = client.completions.create(model=model, stop=[stop], **keep)
    assert r.choices[0].text == kept and r.choices[0].finish_reason == "stop"
    assert stream_text(client, model, stop=[stop], **keep)[0] == [kept]
    chat_kw = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 12, "temperature": 0,
               "extra_body": keep["extra_body"]}
    chat_full = client.chat.completions.create(model=model, **chat_kw).choices[0].message.content
    chat_stop = pick_stop(chat_full)
    chat = client.chat.completions.create(model=model, stop=[chat_stop], **chat_kw)
    assert chat.choices[0].message.content == chat_full[:chat_full.index(chat_stop) + len(chat_stop)]
    # A stop token's text is kept too (vLLM's), and SGLang's no_stop_trim does the same on /generate.
    ids = tokenizer.encode(full, add_special_tokens=False)
    stop_id = next(t for k, t in enumerate(ids) if k >= 2 and t not in ids[:k])
    r = client.completions.create(model=model, stop=None, **dict(keep, extra_body={
        "ignore_eos": True, "include_stop_str_in_output": True, "stop_token_ids": [stop_id]}))
    assert r.choices[0].text == tokenizer.decode(ids[:ids.index(stop_id) + 1])
    gen = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                           "stop_token_ids": [stop_id], "no_stop_trim": True}}
    assert httpx.post(f"{server.url}/generate", json=gen, timeout=30).json()["text"] == r.choices[0].text


def test_return_tokens_as_token_ids(client, model, tokenizer):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    content = r.choices[0].logprobs.content
    ids = [int(t.token.removeprefix("token_id:")) for t in content]
    assert all(t.token.startswith("token_id:") for t in content)
    assert tokenizer.decode(ids) == r.choices[0].message.content
    assert all(alt.token.startswith("token_id:") for t in content for alt in t.top_logprobs)
    c = client.completions.create(model=model, prompt="hi", max_tokens=4, temperature=0, logprobs=1, echo=True,
                                  extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    lp = c.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens) and len(lp.tokens) == len(lp.text_offset)
    assert all(k.startswith("token_id:") for top in lp.top_logprobs if top for k in top)
    plain = client.completions.create(model=model, prompt="hi", max_tokens=4, temperature=0, logprobs=1, echo=True,
                                      extra_body={"ignore_eos": True}).choices[0].logprobs
    assert lp.text_offset == plain.text_offset  # offsets count the tokens' text either way
    assert lp.tokens != plain.tokens


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 1}, "priority"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}, "priority"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}}, "priority"),
])
def test_priority_zero_is_accepted_and_others_refused(server, path, body, param):
    assert httpx.post(f"{server.url}{path}", json=dict(body, priority=0), timeout=30).status_code == 200
    r = httpx.post(f"{server.url}{path}", json=dict(body, priority=5), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert "priority scheduling" in r.json()["error"]["message"]


def test_continue_final_message_and_add_generation_prompt(server, model, tokenizer):
    msgs = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon a"}]

    def tokens(**kw) -> list[int]:
        r = httpx.post(f"{server.url}/v1/tokenize", json={"messages": msgs, **kw}, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    cont = tokens(continue_final_message=True, add_generation_prompt=False)
    assert tokenizer.decode(cont).endswith("<|im_start|>assistant\nOnce upon a")
    closed = tokens(add_generation_prompt=False)
    assert tokenizer.decode(closed).endswith("Once upon a<|im_end|>\n")
    assert tokenizer.decode(tokens()).endswith("<|im_end|>\n<|im_start|>assistant\n")
    body = {"model": model, "messages": msgs, "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json=dict(body, continue_final_message=True, add_generation_prompt=False))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(cont), r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", json=dict(body, continue_final_message=True), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    r = httpx.post(f"{server.url}/v1/chat/completions", json=dict(body, chat_template_kwargs={
        "continue_final_message": True}), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_tools_work_with_no_flags(server, model, client):
    """The default model's template renders no tools: with no --tool-call-parser the server uses its default
    format (tools in the system message, hermes calls), so tools with no tool_choice or "auto" answer (a call
    or text, never a 400), and the round trip with the tool's result is accepted."""
    caps = httpx.get(f"{server.url}/server_info", timeout=10).json()["capabilities"]
    assert (caps["tool_call_parser"], caps["tool_call_format"]) == ("hermes", "default")
    assert {"auto", "required", "named"} <= set(caps["tool_choice"])
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for choice in ({}, {"tool_choice": "auto"}, {"tool_choice": "none"}):
        r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=4, **choice)
        assert r.choices[0].message.content or r.choices[0].message.tool_calls
    # The tools are in the prompt: /tokenize with the same messages and tools counts the same tokens.
    count = httpx.post(f"{server.url}/v1/tokenize", timeout=10,
                       json={"messages": messages, "tools": TOOLS}).json()["count"]
    assert r.usage.prompt_tokens == count > httpx.post(f"{server.url}/v1/tokenize", timeout=10, json={
        "messages": messages}).json()["count"] + 50
    round_trip = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]
    r = client.chat.completions.create(model=model, messages=round_trip, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    longer = httpx.post(f"{server.url}/v1/tokenize", timeout=10,
                        json={"messages": round_trip, "tools": TOOLS}).json()["count"]
    assert r.usage.prompt_tokens == longer > count + 20  # the call and its result are rendered, not dropped


def test_openapi_operation_ids_are_unique(model_dir):
    from server.args import ServerArgs
    from server.detokenizer import load_tokenizer
    from server.http_server import AppState, create_app
    from server.metrics import ServerMetrics
    from server.tokenizer_manager import TokenizerManager

    tm = TokenizerManager(load_tokenizer(str(model_dir)), ipc=None, info={"context_len": 512, "num_kv_slots": 1000},
                          metrics=ServerMetrics())
    app = create_app(AppState(args=ServerArgs(model_path=str(model_dir), device="cpu"), info={}, tokenizer_manager=tm,
                              served_model_name="m"))
    ops = [(op["operationId"], method, path) for path, item in app.openapi()["paths"].items()
           for method, op in item.items()]
    ids = [i for i, _, _ in ops]
    assert len(ids) == len(set(ids)), sorted(ops)
    paths = {path for _, _, path in ops}
    assert {"/v1/tokenize", "/v1/detokenize", "/version", "/health_generate", "/get_model_info"} <= paths
