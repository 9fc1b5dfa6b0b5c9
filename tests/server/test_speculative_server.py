"""Speculative decoding through the real server on the default model (CPU, float32): greedy outputs equal the plain
server's (quoting prompts, a stop string, json_schema, n = 2, logprobs), the counts in /generate's meta_info,
/server_info and /metrics; the flags' one-line start-up errors."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.fake_scheduler import ServerProcess

PARAGRAPH = ("The old mill by the river turned its wheel for two hundred years, grinding wheat for the village and "
             "the farms around it. When the railway came, the miller's sons left for the city, and the wheel "
             "stopped.")
QUOTE = f"Repeat this paragraph word for word:\n\n{PARAGRAPH}"


# Both servers in float32: there the verify pass and the decode step compute the same logits to rounding far below
# any two tokens' gap, so greedy outputs are equal token for token. In bfloat16 (the CPU's default format, and a
# GPU's) they round apart, as two batch shapes do, and an output may take the other of two near-tied tokens.
FLOAT32 = ("--max-total-tokens", "8192", "--dtype", "float32")


@pytest.fixture(scope="module")
def plain_server(model_dir):
    srv = ServerProcess(*FLOAT32, fake=False, quick_start=True).wait_healthy(timeout=300)
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]


@pytest.fixture(scope="module")
def spec_server(model_dir):
    srv = ServerProcess(*FLOAT32, "--speculative-algorithm", "NGRAM", fake=False,
                        quick_start=True).wait_healthy(timeout=300)
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]


def chat(url: str, content: str, **extra) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 48, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def completion(url: str, prompt: str, **extra) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "temperature": 0, "max_tokens": 32, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
          "required": ["name", "year"]}


def requests_for(url: str) -> dict:
    calls = {
        "quote": lambda: chat(url, QUOTE),
        "quote_stop": lambda: chat(url, QUOTE, stop=["railway"]),
        "json": lambda: chat(url, f"Give the mill's name and year as JSON. {PARAGRAPH}",
                             response_format={"type": "json_schema",
                                              "json_schema": {"name": "mill", "schema": SCHEMA}}),
        "n2": lambda: chat(url, QUOTE, n=2, max_tokens=24),
        "logprobs": lambda: completion(url, f"{PARAGRAPH}\n\nThe same paragraph again:\n\n", logprobs=2),
        "prose": lambda: chat(url, "Name three colours.", max_tokens=24),
    }
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(fn) for name, fn in calls.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def both(plain_server, spec_server):
    return requests_for(plain_server.url), requests_for(spec_server.url)


def test_greedy_outputs_equal_the_plain_servers(both):
    plain, spec = both
    for name in ("quote", "quote_stop", "json", "n2", "prose"):
        a = [(c["message"]["content"], c["finish_reason"]) for c in plain[name]["choices"]]
        b = [(c["message"]["content"], c["finish_reason"]) for c in spec[name]["choices"]]
        assert a == b, name
        assert plain[name]["usage"]["completion_tokens"] == spec[name]["usage"]["completion_tokens"], name
    assert plain["quote_stop"]["choices"][0]["finish_reason"] == "stop"
    assert "railway" not in spec["quote_stop"]["choices"][0]["message"]["content"]
    assert len(spec["n2"]["choices"]) == 2


def test_logprobs_equal_the_plain_servers(both):
    plain, spec = both
    a, b = plain["logprobs"]["choices"][0], spec["logprobs"]["choices"][0]
    assert a["text"] == b["text"]
    assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]):
        assert abs(x - y) < 1e-3
    assert [list(t) for t in a["logprobs"]["top_logprobs"]] == [list(t) for t in b["logprobs"]["top_logprobs"]]


def test_counts_in_meta_info_server_info_and_metrics(spec_server, both):
    r = httpx.post(f"{spec_server.url}/generate", json={"text": f"{PARAGRAPH}\n\nAgain:\n\n{PARAGRAPH[:40]}",
                                                         "sampling_params": {"max_new_tokens": 24,
                                                                             "temperature": 0}}, timeout=300)
    meta = r.json()["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accept_token_num"] > 0
    assert meta["spec_draft_token_num"] >= meta["spec_accept_token_num"]
    info = httpx.get(f"{spec_server.url}/server_info", timeout=30).json()
    assert info["scheduler_info"]["speculative"]["algorithm"] == "NGRAM"
    assert info["scheduler_info"]["speculative"]["num_draft_tokens"] == 4
    assert info["stats"]["spec_accept_length"] > 1.0
    metrics = httpx.get(f"{spec_server.url}/metrics", timeout=30).text
    line = next(x for x in metrics.splitlines() if x.startswith("duet_spec_accept_length "))
    assert float(line.split()[1]) > 1.0


def lossless_prompts(n: int) -> list[str]:
    """n prompts that quote varied real text (so that NGRAM drafts hit and miss): a snippet, then its start."""
    texts = json.loads((Path(__file__).parents[2] / "benchmarks" / "cpu_quality_texts.json").read_text())["texts"]
    texts = [t for t in texts if "text" in t]  # (the chat sample has messages instead)
    out = []
    for i in range(n):
        text = texts[i % len(texts)]["text"]
        start = (i * 97) % max(1, len(text) - 400)
        snippet = text[start:start + 240]
        out.append(f"{snippet}\n\nThe same text again:\n\n{snippet[:30 + i % 40]}")
    return out


def generate_all(url: str, prompts: list[str], concurrency: int) -> list[list[int]]:
    """Greedy output ids of each prompt (one /generate each, `concurrency` in flight), in order."""
    def one(prompt):
        r = httpx.post(f"{url}/generate", json={"text": prompt, "sampling_params": {
            "max_new_tokens": 16, "temperature": 0}}, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


# Prompts of the lossless check: 24 in CI; DUET_LOSSLESS_PROMPTS=200 for the full check (about 3 minutes).
LOSSLESS_PROMPTS = int(os.environ.get("DUET_LOSSLESS_PROMPTS", "24"))


def test_quoting_prompts_give_the_plain_servers_tokens(plain_server, spec_server):
    """Prompts through /generate, greedy, 16 tokens: the speculating server (4 in flight, so that every request
    may draft) returns the plain server's tokens, token for token."""
    prompts = lossless_prompts(LOSSLESS_PROMPTS)
    plain = generate_all(plain_server.url, prompts, 32)
    before = httpx.get(f"{spec_server.url}/server_info", timeout=30).json()["stats"]
    spec = generate_all(spec_server.url, prompts, 4)
    after = httpx.get(f"{spec_server.url}/server_info", timeout=30).json()["stats"]
    assert [i for i, (a, b) in enumerate(zip(plain, spec)) if a != b] == []
    assert len(spec) == len(prompts) and all(len(o) == 16 for o in plain)
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < drafted, (accepted, drafted)  # drafts verified, some kept, some rejected


@pytest.mark.parametrize("argv, message", [
    (["--speculative-algorithm", "EAGLE3"], "needs --speculative-draft-model-path"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "x", "--speculative-eagle-topk", "4"],
     "tree drafts"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "x", "--speculative-num-steps",
      "3", "--speculative-num-draft-tokens", "3"], "must be --speculative-num-steps + 1"),
    (["--speculative-num-draft-tokens", "4"], "needs --speculative-algorithm"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"], "must be in [2,"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "5",
      "--speculative-ngram-max-match-window-size", "2"], "must not exceed"),
    (["--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "4"], "does not apply"),
    (["--speculative-algorithm", "NGRAM", "--tp-size", "2"], "--tp-size > 1 is not built yet"),
    (["--speculative-algorithm", "NGRAM", "--is-embedding"], "does not apply to --is-embedding"),
    (["--speculative-algorithm", "NGRAM", "--enable-lora"], "with LoRA adapters"),
    (["--speculative-algorithm", "ngram"], "invalid choice"),
])
def test_flag_errors_are_one_line_with_exit_2(argv, message):
    proc = subprocess.run([sys.executable, "-m", "server.launch_server", "--device", "cpu", *argv],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch_server: error:") and message in lines[0], proc.stderr


def test_a_missing_draft_model_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "server.launch_server", "--device", "cpu", "--speculative-algorithm",
                           "STANDALONE", "--speculative-draft-model-path", "x"],
                          check=False, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "--speculative-draft-model-path" in lines[0], proc.stderr
