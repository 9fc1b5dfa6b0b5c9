"""Load with client disconnects on the real engine and the default model (SmolLM2-135M-Instruct, CPU).

Two rounds of streaming requests (completions by text and by token ids, chat, native /generate) with
mixed prompt lengths (some sharing a prefix, so the radix cache is busy) and mixed max_tokens
(ignore_eos), at a fixed concurrency; 20% of the clients close the stream early, after a random number of
chunks or a random delay. Afterwards:

* every request that was not disconnected finished with exactly max_tokens tokens: usage /
  meta_info count them, and with logprobs on every token is its own chunk, so the chunks are counted too;
* the server is idle: no running, waiting or in-flight request, no KV slot or request row held by a
  request (every slot free or in the prefix cache; after /flush_cache every slot free);
* the metrics account for the requests (no "error" outcome; at least one "length" per completed one);
* the resident memory of the server's process tree after round 2 is within a bound of round 1's.

CI: 2 x 200 requests at concurrency 32, max_tokens 1..24 (~45 s a round alone on 2 cores).
DUET_LONG=1: 2 x 1000 at 64, max_tokens 1..64 (15-20 min a round). A round fails as hung when no stream
receives anything for STALL_S, not after a fixed time, so a busy machine slows the test without failing it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time

import httpx
import pytest

from tests.fake_scheduler import ServerProcess
from tests.reliability_utils import (
    LONG,
    MiB,
    metric_values,
    process_name,
    server_info,
    size,
    tree_rss,
    wait_idle,
)

N_REQUESTS = size(200, 1000)
CONCURRENCY = size(32, 64)
MAX_TOKENS = size(24, 64)
DISCONNECT_FRACTION = 0.2
# A hang is "no stream received anything for STALL_S" (a watchdog fails the round then); ROUND_TIMEOUT_S is
# only an outer cap. A fixed round time would fail on a busy shared machine, where a round can take 5x longer.
STALL_S = 120.0
ROUND_TIMEOUT_S = size(1200.0, 5400.0)
# Memory growth allowed between the end of round 1 and the end of round 2 (the same load again), per
# process: see docs/reliability.md for why these bounds.
RSS_GROWTH_BOUND = {"http": 16 * MiB, "detokenizer": 16 * MiB, "scheduler": 32 * MiB}
RSS_GROWTH_OTHER = 8 * MiB
# glibc keeps freed blocks of the heap (here: torch activations of every batch shape), which moves the
# scheduler's RSS by +-70 MiB between equal rounds. Serving blocks of 1 MiB and more from mmap returns them
# to the system when freed, so RSS follows live memory (measured: +-1 MiB between rounds; ~30% slower).
# OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads sleep instead of spinning at barriers. With spinning, one
# other busy process on these 2 cores made a round 4.8x slower (214 s instead of 45 s); passive: 68 s.
SERVER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1024 * 1024), "OMP_WAIT_POLICY": "PASSIVE"}

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu", "the", "a", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with", "as", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "hot", "word", "but", "what", "some", "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an", "each", "she", "which", "do", "their", "time", "if", "will", "way", "about", "many", "then", "them", "write", "would", "like", "so", "these", "her", "long", "make", "thing", "see", "him", "two", "has", "look", "more", "day", "could", "go", "come", "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water", "than", "call", "first", "who", "may", "down", "side", "been", "now", "find", "café", "naïve", "日本語", "😀"]
SHARED_PREFIX = " ".join(WORDS[i % len(WORDS)] for i in range(0, 240, 3))
# A small KV pool (4096 slots; prompt + max_tokens stays under 500): round 1 fills it (the prefix cache keeps
# everything until evicted), so eviction runs and every KV page is touched before memory is compared.
KV_SLOTS = 4096


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess("--max-total-tokens", str(KV_SLOTS), model_dir=model_dir, fake=False,
                        env=SERVER_ENV).wait_healthy(300)
    yield srv
    code = srv.stop()
    assert code == 0, srv.output()[-3000:]


# ---- one client ------------------------------------------------------------------------------------


def make_request(rng: random.Random, vocab: int, disconnects: bool) -> dict:
    kind = rng.choice(["completions", "completions_ids", "chat", "generate"])
    max_tokens = rng.randint(1, MAX_TOKENS)
    n_words = round(2 ** rng.uniform(0, 7))  # 1 .. 128 words, log-uniform
    text = " ".join(rng.choice(WORDS) for _ in range(n_words))
    if rng.random() < 0.3:
        text = SHARED_PREFIX + " " + text
    logprobs = rng.random() < 0.6  # with logprobs every token is its own chunk: the count is exact
    if kind == "completions_ids":
        prompt = [rng.randrange(vocab) for _ in range(max(1, n_words))]
        body = {"prompt": prompt, "max_tokens": max_tokens}
    elif kind == "completions":
        body = {"prompt": text, "max_tokens": max_tokens}
    elif kind == "chat":
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    else:
        body = {"text": text, "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True,
                                                  "temperature": rng.choice([0.0, 0.7])},
                "return_logprob": logprobs, "stream": True}
    if kind != "generate":
        body.update(stream=True, ignore_eos=True, temperature=rng.choice([0.0, 0.7, 1.0]),
                    stream_options={"include_usage": True})
        if logprobs and kind == "chat":
            body.update(logprobs=True, top_logprobs=rng.choice([0, 2]))
        elif logprobs:
            body["logprobs"] = rng.choice([0, 2])
    disconnect = None
    if disconnects:
        # After k data events (0: right after the headers), or after a delay (maybe before the headers).
        disconnect = ("events", rng.randrange(max_tokens)) if rng.random() < 0.7 else \
            ("delay", rng.uniform(0.0, 1.5))
    path = "/generate" if kind == "generate" else "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return {"kind": kind, "path": path, "body": body, "max_tokens": max_tokens, "logprobs": logprobs,
            "disconnect": disconnect}


def check_events(req: dict, events: list[dict]) -> None:
    """A complete stream: exactly max_tokens tokens, counted in the usage and (with logprobs) in chunks."""
    n, kind = req["max_tokens"], req["kind"]
    assert events, "no events"
    assert not any("error" in e for e in events), events[-1]
    if kind == "generate":
        last = events[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "length", last["meta_info"]
        assert last["meta_info"]["completion_tokens"] == n and len(last["output_ids"]) == n
        # Every event brings new token ids (output_ids is cumulative): one per step, or fewer events when tokens
        # that queued while the HTTP process was busy went out together.
        lens = [len(e["output_ids"]) for e in events]
        assert 0 < lens[0] and all(a < b for a, b in itertools.pairwise(lens)), lens
        if req["logprobs"]:
            assert len(last["meta_info"]["output_token_logprobs"]) == n
        return
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == n, usage
    chunks = [e for e in events[:-1] if e["choices"]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finishes == ["length"], finishes
    if kind == "chat":
        assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
        chunks = chunks[1:]
    assert 1 <= len(chunks) <= n  # fewer than n when tokens that queued went out together
    if req["logprobs"]:
        if kind == "chat":
            assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks) == n
        else:
            assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == n


async def run_one(client: httpx.AsyncClient, url: str, req: dict, progress: dict) -> str:
    """'completed', 'disconnected' (we closed the stream before the end) or raises on a broken stream."""
    events: list[dict] = []
    disconnect = req["disconnect"]

    async def consume() -> str:
        async with client.stream("POST", url + req["path"], json=req["body"]) as resp:
            assert resp.status_code == 200, (resp.status_code, await resp.aread())
            if disconnect is not None and disconnect[0] == "events" and disconnect[1] == 0:
                return "disconnected"
            async for line in resp.aiter_lines():
                if not line:
                    continue
                assert line.startswith("data: "), line
                progress["last"] = time.monotonic()
                if line == "data: [DONE]":
                    return "done"
                events.append(json.loads(line[6:]))
                if disconnect is not None and disconnect[0] == "events" and len(events) >= disconnect[1]:
                    return "disconnected"  # leaving the block closes the connection mid-stream
        raise AssertionError("the stream ended without [DONE]")

    if disconnect is not None and disconnect[0] == "delay":
        try:
            outcome = await asyncio.wait_for(consume(), disconnect[1])
        except asyncio.TimeoutError:
            return "disconnected"
    else:
        outcome = await consume()
    if outcome == "disconnected":
        return outcome
    check_events(req, events)
    return "completed"


async def run_round(url: str, seed: int, vocab: int) -> dict:
    rng = random.Random(seed)
    leaving = set(rng.sample(range(N_REQUESTS), round(DISCONNECT_FRACTION * N_REQUESTS)))
    reqs = [make_request(rng, vocab, i in leaving) for i in range(N_REQUESTS)]
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY + 8, max_keepalive_connections=CONCURRENCY)
    failures: list[str] = []
    outcomes = {"completed": 0, "disconnected": 0}
    progress = {"last": time.monotonic()}
    timeout = httpx.Timeout(30.0, read=2 * STALL_S, pool=None)  # the semaphore bounds the pool
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def guarded(i: int, req: dict) -> None:
            async with sem:
                try:
                    outcomes[await run_one(client, url, req, progress)] += 1
                except Exception as e:  # noqa: BLE001 - collected and reported together
                    failures.append(f"request {i} ({req['kind']}, max_tokens={req['max_tokens']}, "
                                    f"disconnect={req['disconnect']}): {type(e).__name__}: {e}"[:600])

        async def watchdog() -> None:
            while time.monotonic() - progress["last"] < STALL_S:
                await asyncio.sleep(1.0)
            async with httpx.AsyncClient(timeout=10) as c:
                info = (await c.get(f"{url}/server_info")).json()
            raise AssertionError(f"no stream received anything for {STALL_S:.0f} s: {info}")

        start = time.monotonic()
        work = asyncio.ensure_future(asyncio.gather(*(guarded(i, r) for i, r in enumerate(reqs))))
        guard = asyncio.ensure_future(watchdog())
        try:
            done, _ = await asyncio.wait({work, guard}, timeout=ROUND_TIMEOUT_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            assert done, f"the round did not finish within {ROUND_TIMEOUT_S:.0f} s"
            if guard in done:
                guard.result()  # raises the stall report
            work.result()
        finally:
            for task in (work, guard):
                task.cancel()
            await asyncio.gather(work, guard, return_exceptions=True)
        elapsed = time.monotonic() - start
    assert not failures, f"{len(failures)} requests failed:\n" + "\n".join(failures[:10])
    planned = sum(r["disconnect"] is not None for r in reqs)
    return dict(outcomes, planned_disconnects=planned, seconds=elapsed,
                tokens=sum(r["max_tokens"] for r in reqs if r["disconnect"] is None))


def check_idle_and_clean(url: str) -> dict:
    info = wait_idle(url)
    s = info["stats"]
    assert s["kv_free"] + s["kv_cached"] == s["kv_total"], s
    assert s["req_rows_free"] == s["req_rows_total"], s
    assert s["num_tracked_reqs"] == 0, s  # the scheduler forgot every finished or aborted request
    return s


# ---- the test ----------------------------------------------------------------------------------------


def test_load_with_disconnects(server):
    url = server.url
    info = server_info(url)
    vocab = info["scheduler_info"]["vocab_size"]
    pid = server.proc.pid
    roles = {info["http_pid"]: "http", info["scheduler_pid"]: "scheduler", info["detokenizer_pid"]: "detokenizer"}
    before = metric_values(url, "duet_requests_total")
    rounds, rss = [], []
    for r in range(2):
        result = run_round_sync(url, seed=1000 + r, vocab=vocab)
        stats = check_idle_and_clean(url)
        rss.append(tree_rss(pid))
        rounds.append(dict(result, stats=stats))
        assert server.proc.poll() is None
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    after = metric_values(url, "duet_requests_total")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    completed = sum(r["completed"] for r in rounds)
    disconnected = sum(r["disconnected"] for r in rounds)
    assert completed + disconnected == 2 * N_REQUESTS  # nothing lost: every request is one or the other
    assert delta.get('finish_reason="error"', 0) == 0, delta
    assert delta.get('finish_reason="length"', 0) >= completed, delta
    assert sum(delta.values()) <= 2 * N_REQUESTS, delta
    # Every slot comes back once the prefix cache is dropped.
    assert httpx.post(f"{url}/flush_cache", timeout=10).json()["success"] is True
    s = server_info(url)["stats"]
    assert s["kv_free"] == s["kv_total"] and s["kv_cached"] == 0, s
    # Memory: round 2 repeats round 1's load; no process of the tree may keep growing.
    total1, total2 = sum(rss[0].values()), sum(rss[1].values())
    growth = {roles.get(p, process_name(p)): rss[1].get(p, 0) - v for p, v in rss[0].items()}
    report = {
        "long": LONG, "requests_per_round": N_REQUESTS, "concurrency": CONCURRENCY, "max_tokens": MAX_TOKENS,
        "rounds": [{k: v for k, v in r.items() if k != "stats"} for r in rounds],
        "metrics_delta": delta,
        "rss_mib": [{roles.get(p, process_name(p)[-30:]): round(v / MiB, 1) for p, v in m.items()} for m in rss],
        "rss_total_mib": [round(total1 / MiB, 1), round(total2 / MiB, 1)],
        "rss_growth_mib": {k: round(v / MiB, 1) for k, v in growth.items()},
        "kv_after_rounds": rounds[-1]["stats"],
    }
    print("\nRELIABILITY-LOAD " + json.dumps(report))
    assert set(rss[0]) == set(rss[1]), "the process tree changed between rounds"
    for role, grew in growth.items():
        assert grew <= RSS_GROWTH_BOUND.get(role, RSS_GROWTH_OTHER), (role, grew / MiB, report)


def run_round_sync(url: str, seed: int, vocab: int) -> dict:
    return asyncio.run(run_round(url, seed, vocab))
