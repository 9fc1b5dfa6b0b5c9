"""The HTTP API against the real scheduler and model on a tiny random Llama (CPU), not the fake scheduler:
logprob values against HF transformers' log-softmax, n + seed, stop strings and stop_token_ids, echo,
cached_tokens, the output-text options (skip_special_tokens, no_stop_trim) through the scheduler; retraction under a small KV pool; a scheduler fault is an HTTP 500 for that request only.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
import torch

from tests.fake_scheduler import ServerProcess, build_tiny_model_folder

PROMPT = [5, 17, 42, 99, 123, 7, 250, 31, 64, 8, 200, 11]  # token ids: the reference sees the same
FAULT_MARKER = [3, 3, 3, 3]  # a prompt starting with these ids raises inside the faulty scheduler


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model_folder(tmp_path_factory.mktemp("real-engine") / "tiny", with_weights=True)


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServerProcess(model_dir=model_path, fake=False).wait_healthy()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def generate(server, input_ids: list[int], **sampling) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "ignore_eos": True, **sampling}}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_logprobs_equal_reference_log_softmax(server, client, model, hf_model):
    r = httpx.post(f"{server.url}/generate", timeout=60, json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        "return_logprob": True, "top_logprobs_num": 3}).json()
    out = r["output_ids"]
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1 : -1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert out == ref.argmax(-1).tolist()  # greedy follows the reference
    chosen = [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]
    assert [t for _, t, _ in r["meta_info"]["output_token_logprobs"]] == out
    torch.testing.assert_close(torch.tensor(chosen), ref.gather(1, torch.tensor(out)[:, None])[:, 0],
                               atol=1e-4, rtol=0)
    top_vals, top_ids = ref.topk(3, dim=-1)
    got = r["meta_info"]["output_top_logprobs"]
    assert [[t for _, t, _ in row] for row in got] == top_ids.tolist()
    torch.testing.assert_close(torch.tensor([[v for v, _, _ in row] for row in got]), top_vals, atol=1e-4, rtol=0)
    # The OpenAI completions endpoint reports the same numbers.
    c = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), torch.tensor(chosen), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor([sorted(t.values(), reverse=True) for t in lp.top_logprobs]),
                               top_vals, atol=1e-4, rtol=0)


def test_n_and_seed_reproducible(client, model):
    kw = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0,
          "extra_body": {"ignore_eos": True}}
    a = client.completions.create(n=3, seed=1234, **kw)
    b = client.completions.create(n=3, seed=1234, **kw)
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) == 3  # each choice has its own seed (seed + i)
    alone = client.completions.create(n=1, seed=1235, **kw)  # the seed of choice 1, in another batch
    assert alone.choices[0].text == texts[1]


def test_stop_token_ids_and_stop_strings(server, client, model, tokenizer_of):
    ids = generate(server, PROMPT, max_new_tokens=12)["output_ids"]
    k = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k])
    r = generate(server, PROMPT, max_new_tokens=12, stop_token_ids=[ids[k]])
    assert r["output_ids"] == ids[: k + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert full == tokenizer_of.decode(ids, skip_special_tokens=True)
    stop = next(full[i:i + 2] for i in range(len(full) // 3, len(full) - 1)
                if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    # The scheduler stopped generating at the token that completed the stop string.
    ends = next(j for j in range(1, len(ids) + 1) if stop in tokenizer_of.decode(ids[:j], skip_special_tokens=True))
    assert r.usage.completion_tokens == ends


@pytest.fixture(scope="module")
def tokenizer_of(model_path):
    from server.detokenizer import load_tokenizer

    return load_tokenizer(str(model_path))


def test_echo(client, model, tokenizer_of):
    prompt = "the quick brown fox"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert echoed == prompt + plain


def test_cached_tokens_are_exact(server):
    prompt = [9, 8, 7, 6, 5, 4, 30, 31, 32, 33]
    first = generate(server, prompt, max_new_tokens=4)
    assert first["meta_info"]["cached_tokens"] == 0
    again = generate(server, prompt, max_new_tokens=4)
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1  # the last token is run for its logits
    assert again["output_ids"] == first["output_ids"]
    other = next(t for t in range(40, 320) if t != first["output_ids"][0])
    longer = generate(server, prompt + [other, other], max_new_tokens=4)
    assert longer["meta_info"]["cached_tokens"] == len(prompt)


def test_output_text_options_reach_the_detokenizer(server, tokenizer_of):
    """skip_special_tokens and no_stop_trim travel from the request through the scheduler to the detokenizer
    (with the request's first output): a forced special token is written, and a stop token's text kept."""
    special = tokenizer_of.convert_tokens_to_ids("<|im_start|>")
    forced = {"max_new_tokens": 2, "logit_bias": {str(special): 100}}
    assert generate(server, PROMPT, **forced)["text"] == ""
    assert generate(server, PROMPT, skip_special_tokens=False, **forced)["text"] == "<|im_start|>" * 2
    ids = generate(server, PROMPT, max_new_tokens=12)["output_ids"]
    k = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k] and ids[k] not in tokenizer_of.all_special_ids)
    kept = generate(server, PROMPT, max_new_tokens=12, stop_token_ids=[ids[k]], no_stop_trim=True)
    assert kept["output_ids"] == ids[:k + 1] and kept["text"] == tokenizer_of.decode(ids[:k + 1])


# ---- memory pressure: retraction through the server ----------------------------------------------


def test_retraction_keeps_greedy_outputs(server, model_path):
    prompts = [[10 + i, 20 + i, 30 + i] + PROMPT for i in range(6)]

    def outputs(srv) -> list[list[int]]:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: generate(srv, p, max_new_tokens=48)["output_ids"], prompts))

    expected = outputs(server)
    # 6 x (15 + 48) tokens in a 120-slot pool: any two requests alive at once outgrow it, and the newest is
    # retracted. (With 16 new tokens each a loaded machine could start the requests far enough apart that none
    # overlapped enough: a flake seen twice in full CI runs.)
    small = ServerProcess("--max-total-tokens", "120", model_dir=model_path, fake=False).wait_healthy()
    try:
        assert outputs(small) == expected
        stats = httpx.get(f"{small.url}/server_info", timeout=10).json()["stats"]
        assert stats["num_retractions"] > 0
        assert stats["kv_used"] == 0 and stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]
    finally:
        assert small.stop() == 0


# ---- a scheduler fault: HTTP 500 for that request, the others complete --------------------------


def run_faulty_scheduler_process(args, ipc, ready_conn) -> None:
    """The real scheduler process, except that a decode batch holding a request whose prompt starts with
    FAULT_MARKER raises in sampling."""
    from scheduler.scheduler import Scheduler
    from server import scheduler_entry

    sample = Scheduler._sample

    def faulty_sample(self, logits, reqs, *args):
        if any(r.num_sampled and r.input_ids[: len(FAULT_MARKER)] == FAULT_MARKER for r in reqs):
            raise RuntimeError("injected fault")
        return sample(self, logits, reqs, *args)

    Scheduler._sample = faulty_sample
    scheduler_entry.run_scheduler_process(args, ipc, ready_conn)


@pytest.fixture(scope="module")
def faulty_server(model_path):
    srv = ServerProcess(model_dir=model_path, test_scheduler="tests.server.test_server_real_engine:run_faulty_scheduler_process")
    srv.wait_healthy()
    yield srv
    assert srv.stop() == 0


def stats(srv) -> dict:
    return httpx.get(f"{srv.url}/server_info", timeout=10).json()["stats"]


def test_scheduler_fault_fails_only_that_request(server, faulty_server):
    prompts = [[10 + i] + PROMPT for i in range(4)]
    n = 150  # long enough to be still decoding when the faulty request joins their batch
    expected = [generate(server, p, max_new_tokens=n)["output_ids"] for p in prompts]
    body = {"prompt": FAULT_MARKER + PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        good = pool.map(lambda p: generate(faulty_server, p, max_new_tokens=n)["output_ids"], prompts)
        while stats(faulty_server)["num_running"] < len(prompts):
            time.sleep(0.01)  # poll until all four decode together
        resp = httpx.post(f"{faulty_server.url}/v1/completions", json=body, timeout=60)
        good = list(good)
    assert resp.status_code == 500
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert (err["code"], err["type"]) == (500, "InternalServerError") and "injected fault" in err["message"]
    assert good == expected
    log = faulty_server.output()
    assert "a batch of 5 requests failed (RuntimeError: injected fault)" in log  # it was not alone
    assert "failed in the scheduler: RuntimeError: injected fault" in log
    assert httpx.get(f"{faulty_server.url}/health", timeout=10).status_code == 200
    after = stats(faulty_server)
    assert after["num_running"] == 0 and after["kv_used"] == 0
    assert after["kv_free"] + after["kv_cached"] == after["kv_total"]
    assert after["req_rows_free"] == after["req_rows_total"]
