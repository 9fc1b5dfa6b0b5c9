"""Prompt logprobs over HTTP, against the real scheduler on a tiny random Llama (CPU) with 8-token prefill
chunks: completions with echo + logprobs (OpenAI's legacy shape, streamed and not, max_tokens 0), vLLM's
prompt_logprobs, and SGLang's /generate with return_logprob + logprob_start_len; values against HF."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tests.fake_scheduler import ServerProcess, build_tiny_model_folder

PROMPT = [5, 17, 42, 99, 123, 7, 250, 31, 64, 8, 200, 11, 90, 3, 77, 150, 19, 240, 66, 12]  # 20: three chunks


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model_folder(tmp_path_factory.mktemp("prompt-lp") / "tiny", with_weights=True)


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServerProcess("--chunked-prefill-size", "8", model_dir=model_path, fake=False).wait_healthy()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref(model_path) -> torch.Tensor:
    """HF's log_softmax at every prompt position (row p scores the token at p + 1)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def expected(ref: torch.Tensor) -> list[float]:
    return ref[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])].tolist()


def test_echo_with_logprobs_covers_prompt_then_output(client, ref):
    r = client.completions.create(prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2,
                                  model="tiny", extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    plain = client.completions.create(prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, model="tiny",
                                      extra_body={"ignore_eos": True})
    out = plain.choices[0].logprobs
    n = len(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:n]), torch.tensor(expected(ref)), atol=1e-4, rtol=0)
    # Each prompt position lists its token and the 2 best (3 entries when the token is not among them).
    best = ref[: n - 1].topk(2, dim=-1).values
    for k in range(1, n):
        top = lp.top_logprobs[k]
        assert lp.tokens[k] in top and len(top) in (2, 3)
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(best[k - 1].tolist(), abs=1e-4)
    assert lp.text_offset[:n] == sorted(lp.text_offset[:n]) and lp.text_offset[0] == 0
    # The output part is what the same request without echo reports.
    assert lp.tokens[n:] == out.tokens and lp.token_logprobs[n:] == pytest.approx(out.token_logprobs, abs=1e-5)
    assert r.choices[0].text.endswith(plain.choices[0].text)
    assert r.usage.completion_tokens == 4


def test_echo_with_max_tokens_0_scores_the_prompt_only(client, ref):
    r = client.completions.create(prompt=PROMPT, max_tokens=0, echo=True, logprobs=0, model="tiny")
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) and lp.token_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), torch.tensor(expected(ref)), atol=1e-4, rtol=0)
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text == client.completions.create(prompt=PROMPT, max_tokens=0, echo=True,
                                                          model="tiny").choices[0].text


def test_streamed_echo_logprobs_equal_the_collected_ones(server):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1, "ignore_eos": True}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    lps = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            for k, v in (choice["logprobs"] or {}).items():
                lps[k] += v
    assert text == whole["text"]
    assert lps == whole["logprobs"]


def test_vllm_prompt_logprobs(server, ref):
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert choice["logprobs"] is None and len(plp) == len(PROMPT) and plp[0] is None
    ranks = (ref[: len(PROMPT) - 1] >= torch.tensor(expected(ref)).unsqueeze(1)).sum(-1).tolist()
    for k in range(1, len(PROMPT)):
        entry = plp[k][str(PROMPT[k])]
        assert entry["logprob"] == pytest.approx(expected(ref)[k - 1], abs=1e-4)
        assert entry["rank"] == ranks[k - 1]
        assert {e["rank"] for t, e in plp[k].items() if t != str(PROMPT[k])} <= {1, 2}


def generate(server, **body) -> dict:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, **body}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


@pytest.mark.parametrize("start", [0, 9])
def test_generate_input_token_logprobs(server, ref, start):
    meta = generate(server, logprob_start_len=start, top_logprobs_num=2, return_text_in_logprobs=True)
    lps, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(lps) == len(tops) == len(PROMPT) - start
    assert lps[0][0] is None and lps[0][1] == PROMPT[start] and isinstance(lps[0][2], str) and tops[0] is None
    assert [t for _, t, _ in lps] == PROMPT[start:]
    torch.testing.assert_close(torch.tensor([v for v, _, _ in lps[1:]]), torch.tensor(expected(ref)[start:]),
                               atol=1e-4, rtol=0)
    best_vals, best_ids = ref[start : len(PROMPT) - 1].topk(2, dim=-1)
    assert [[t for _, t, _ in row] for row in tops[1:]] == best_ids.tolist()
    torch.testing.assert_close(torch.tensor([[v for v, _, _ in row] for row in tops[1:]]), best_vals, atol=1e-4, rtol=0)
    assert len(meta["output_token_logprobs"]) == 2 and isinstance(meta["output_token_logprobs"][0][2], str)


def test_generate_defaults_to_no_input_logprobs_and_scores_with_0_new_tokens(server, ref):
    meta = generate(server)
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs"][0][2] is None
    meta = generate(server, logprob_start_len=0, sampling_params={"max_new_tokens": 0})
    assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    assert [v for v, _, _ in meta["input_token_logprobs"][1:]] == pytest.approx(expected(ref), abs=1e-4)
