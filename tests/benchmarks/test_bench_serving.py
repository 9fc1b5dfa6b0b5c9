"""CPU tests for benchmarks/bench_serving.py and benchmarks/plot.py (no model, loopback only)."""

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest

from benchmarks import bench_serving as bs
from benchmarks.bench_serving import RequestRecord, compute_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# Metric definitions on scripted records
# --------------------------------------------------------------------------------------------


def _records() -> list[RequestRecord]:
    return [
        # 4 tokens, usage reported: TTFT 100 ms, ITLs 100/100/200 ms, E2EL 500 ms, TPOT 400/3 ms.
        RequestRecord(
            prompt_len=10,
            expected_output_len=4,
            send_time=0.0,
            chunk_times=[0.1, 0.2, 0.3, 0.5],
            output_tokens=4,
            success=True,
        ),
        # No usage -> falls back to the requested 2 tokens: TTFT 300, ITL 100, E2EL 400, TPOT 100.
        RequestRecord(
            prompt_len=20,
            expected_output_len=2,
            send_time=1.0,
            chunk_times=[1.3, 1.4],
            output_tokens=None,
            success=True,
        ),
        # One output token: TTFT 200, E2EL 200, no ITL, no TPOT.
        RequestRecord(
            prompt_len=30,
            expected_output_len=1,
            send_time=2.0,
            chunk_times=[2.2],
            output_tokens=1,
            success=True,
        ),
        # Two chunks carrying 5 tokens (usage says 5): TTFT 50, ITL 200, E2EL 250, TPOT 200/4 = 50.
        RequestRecord(
            prompt_len=40,
            expected_output_len=8,
            send_time=3.0,
            chunk_times=[3.05, 3.25],
            output_tokens=5,
            success=True,
        ),
        # Failed: contributes nothing but the failed count and its error.
        RequestRecord(
            prompt_len=50,
            expected_output_len=4,
            send_time=3.5,
            chunk_times=[3.6],
            success=False,
            error="HTTP 500: boom",
        ),
    ]


def test_metrics_exact():
    m = compute_metrics(_records(), duration=4.0, percentiles=(50, 99))
    approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-9)

    assert m["completed"] == 4
    assert m["failed"] == 1
    assert m["duration"] == 4.0
    assert m["total_input_tokens"] == 10 + 20 + 30 + 40
    assert m["total_output_tokens"] == 4 + 2 + 1 + 5
    assert m["usage_missing"] == 1
    assert m["request_throughput"] == approx(1.0)
    assert m["input_throughput"] == approx(25.0)
    assert m["output_throughput"] == approx(3.0)
    assert m["total_token_throughput"] == approx(28.0)

    # TTFT population [100, 300, 200, 50] ms.
    assert m["mean_ttft_ms"] == approx(162.5)
    assert m["median_ttft_ms"] == approx(150.0)
    assert m["p50_ttft_ms"] == approx(150.0)
    assert m["p99_ttft_ms"] == approx(200 + 0.97 * 100)  # linear interpolation of sorted values
    # TPOT population [400/3, 100, 50] ms (the 1-token request is skipped).
    assert m["mean_tpot_ms"] == approx((400 / 3 + 100 + 50) / 3)
    assert m["median_tpot_ms"] == approx(100.0)
    assert m["p99_tpot_ms"] == approx(100 + 0.98 * (400 / 3 - 100))
    # ITL pooled over requests: [100, 100, 200] + [100] + [] + [200].
    assert m["mean_itl_ms"] == approx(140.0)
    assert m["median_itl_ms"] == approx(100.0)
    assert m["p99_itl_ms"] == approx(200.0)
    # E2EL [500, 400, 200, 250].
    assert m["mean_e2el_ms"] == approx(337.5)
    assert m["median_e2el_ms"] == approx(325.0)
    assert m["p99_e2el_ms"] == approx(400 + 0.97 * 100)
    assert m["std_e2el_ms"] == approx(float(np.std([500, 400, 200, 250])))

    assert m["errors"] == ["", "", "", "", "HTTP 500: boom"]
    assert m["input_lens"] == [10, 20, 30, 40, 50]
    assert m["output_lens"] == [4, 2, 1, 5, 0]
    assert m["ttfts"] == approx([0.1, 0.3, 0.2, 0.05, 0.0])
    assert [len(x) for x in m["itls"]] == [3, 1, 0, 1, 0]


def test_metrics_all_failed_and_table():
    recs = [RequestRecord(prompt_len=5, expected_output_len=3, error="x") for _ in range(3)]
    with pytest.warns(UserWarning):
        m = compute_metrics(recs, duration=1.0)
    assert m["completed"] == 0 and m["failed"] == 3
    assert m["total_output_tokens"] == 0
    for name in bs.LATENCY_METRICS:
        assert m[f"mean_{name}_ms"] == 0.0 and m[f"p99_{name}_ms"] == 0.0
    table = bs.format_result_table(m)
    assert "Serving Benchmark Result" in table and "Failed requests:" in table
    assert "[3x] x" in table


def test_sample_lengths_follow_vllm_range():
    rng = np.random.default_rng(0)
    lens = bs.sample_lengths(rng, 2000, 100, 0.25)
    assert lens.min() == 75 and lens.max() == 125  # [floor(L(1-r)), ceil(L(1+r))], both ends hit
    assert (bs.sample_lengths(rng, 10, 64, 0.0) == 64).all()
    with pytest.raises(ValueError):
        bs.sample_lengths(rng, 1, 10, 1.0)


# --------------------------------------------------------------------------------------------
# Tiny tokenizer (no download) and a fake OpenAI-compatible streaming server
# --------------------------------------------------------------------------------------------

VOCAB_WORDS = [f"w{i}" for i in range(200)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[BOS]": 1}
    for w in VOCAB_WORDS:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]")
    d = tmp_path_factory.mktemp("tiny_tok")
    fast.save_pretrained(str(d))
    return str(d)


def test_sampling_exact_lengths(tokenizer_dir):
    tok = bs.load_tokenizer(tokenizer_dir)
    reqs = bs.sample_random_requests(tok, 20, 32, 8, range_ratio=0.5, seed=3, prompt_format="token-ids")
    special = set(tok.all_special_ids)
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert 16 <= r.prompt_len <= 48 and 4 <= r.output_len <= 12
        assert not special.intersection(r.prompt)
    again = bs.sample_random_requests(tok, 20, 32, 8, range_ratio=0.5, seed=3, prompt_format="token-ids")
    assert [r.prompt for r in again] == [r.prompt for r in reqs]  # seeded

    texts = bs.sample_random_requests(tok, 10, 24, 8, seed=1, prompt_format="text")
    for r in texts:
        assert isinstance(r.prompt, str)
        assert r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=True)) == 24


class FakeServer:
    """FastAPI app in a uvicorn thread on 127.0.0.1:<free port>.

    Request number ``fail_at`` (1-based, counting warm-ups) gets HTTP 500; number ``break_at``
    streams two chunks and then drops the connection mid-stream.
    """

    def __init__(self, fail_at: int = 0, break_at: int = 0, chunk_sleep: float = 0.002,
                 server_info: dict | None = None):
        import uvicorn
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse

        self.fail_at, self.break_at, self.chunk_sleep = fail_at, break_at, chunk_sleep
        self.count = 0
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0
        app = FastAPI()

        @app.get("/v1/models")
        async def models_():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.get("/server_info")
        async def server_info_():
            if server_info is None:
                return JSONResponse({"error": {"message": "No route"}}, status_code=404)
            return server_info

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.count += 1
            n = self.count
            self.bodies.append(body)
            self.auth.append(request.headers.get("authorization"))
            if n == self.fail_at:
                return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
            max_tokens = int(body["max_tokens"])
            prompt = body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())

            async def gen():
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    for i in range(max_tokens):
                        await asyncio.sleep(self.chunk_sleep)
                        if n == self.break_at and i == 2:
                            raise RuntimeError("injected broken stream")
                        chunk = {
                            "id": f"cmpl-{n}",
                            "object": "text_completion",
                            "model": "fake-model",
                            "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}],
                        }
                        yield f"data: {json.dumps(chunk)}\n\n"
                    final = {
                        "id": f"cmpl-{n}",
                        "object": "text_completion",
                        "model": "fake-model",
                        "choices": [],
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": max_tokens,
                            "total_tokens": prompt_tokens + max_tokens,
                        },
                    }
                    yield f"data: {json.dumps(final)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self.in_flight -= 1

            return StreamingResponse(gen(), media_type="text/event-stream")

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="critical", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def _check_result(res: dict, num_prompts: int):
    for k in bs.METRIC_KEYS:
        assert k in res, k
    for name in bs.LATENCY_METRICS:
        for stat in ("mean", "median", "p99"):
            assert f"{stat}_{name}_ms" in res
        assert res[f"median_{name}_ms"] <= res[f"p99_{name}_ms"] + 1e-9
    for k in (
        "request_rate",
        "max_concurrency",
        "num_prompts",
        "random_input_len",
        "random_output_len",
        "random_range_ratio",
        "base_url",
        "model",
        "date",
        "errors",
        "seed",
        "prompt_format",
    ):
        assert k in res, k
    assert res["completed"] + res["failed"] == num_prompts == res["num_prompts"]
    assert len(res["errors"]) == num_prompts
    assert sum(res["output_lens"]) == res["total_output_tokens"]
    ok = [i for i, e in enumerate(res["errors"]) if not e]
    assert sum(res["input_lens"][i] for i in ok) == res["total_input_tokens"]
    # Every request starts and ends inside the timed run.
    assert res["duration"] * 1000 >= max(res["p99_e2el_ms"], res["mean_e2el_ms"]) > 0
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / res["duration"])
    assert res["request_throughput"] == pytest.approx(res["completed"] / res["duration"])


@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_end_to_end_against_fake_server(tokenizer_dir, tmp_path, capsys, client):
    out = tmp_path / "res.json"
    n = 12
    # Request 1 is the warm-up; request 3 gets HTTP 500, request 6 breaks mid-stream.
    with FakeServer(fail_at=3, break_at=6) as srv:
        res = bs.main(
            [
                "--base-url",
                srv.url,
                "--tokenizer",
                tokenizer_dir,
                "--num-prompts",
                str(n),
                "--request-rate",
                "200",
                "--max-concurrency",
                "4",
                "--random-input-len",
                "16",
                "--random-output-len",
                "6",
                "--random-range-ratio",
                "0.5",
                "--seed",
                "7",
                "--output-file",
                str(out),
                "--disable-tqdm",
                "--api-key",
                "sekret",
                "--metric-percentiles",
                "50,99",
                "--label",
                "fake",
                "--http-client",
                client,
            ]
        )
        bodies, auth, max_in_flight = srv.bodies, srv.auth, srv.max_in_flight

    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TPOT (ms):" in printed
    on_disk = json.loads(out.read_text())
    assert on_disk["completed"] == res["completed"]
    _check_result(on_disk, n)
    assert on_disk["model"] == "fake-model"  # discovered via GET /v1/models
    assert on_disk["failed"] == 2 and on_disk["completed"] == n - 2
    errs = [e for e in on_disk["errors"] if e]
    assert any(e.startswith("HTTP 500") for e in errs)
    assert any("RemoteProtocolError" in e or "incomplete" in e.lower() for e in errs), errs
    assert on_disk["max_concurrency"] == 4 and on_disk["request_rate"] == 200.0
    assert on_disk["label"] == "fake"
    assert on_disk["usage_missing"] == 0 and on_disk["prompt_len_mismatches"] == 0

    # The server's usage counts were used, and they equal the requested lengths.
    assert len(bodies) == n + 1
    timed = bodies[1:]
    for b in bodies:
        assert b["stream"] is True and b["ignore_eos"] is True and b["temperature"] == 0
        assert b["stream_options"] == {"include_usage": True}
        assert isinstance(b["prompt"], list) and all(isinstance(t, int) for t in b["prompt"])
        assert 8 <= len(b["prompt"]) <= 24 and 3 <= b["max_tokens"] <= 9
    # Server arrival order may differ from sampling order under concurrency: compare as multisets.
    assert sorted(on_disk["input_lens"]) == sorted(len(b["prompt"]) for b in timed)
    ok_bodies = [b for i, b in enumerate(bodies) if i not in (0, 2, 5)]  # warm-up, 500, broken
    assert on_disk["total_input_tokens"] == sum(len(b["prompt"]) for b in ok_bodies)
    ok_out = [b["max_tokens"] for b in ok_bodies]
    assert sum(ok_out) == on_disk["total_output_tokens"]
    assert all(a == "Bearer sekret" for a in auth)
    assert max_in_flight <= 4
    assert 1 <= on_disk["max_concurrent_requests"] <= 4
    # Each stream has max_tokens text chunks -> max_tokens - 1 ITLs per successful request.
    assert sum(len(x) for x in on_disk["itls"]) == sum(m - 1 for m in ok_out)
    assert on_disk["text_chunks_per_output_token"] == 1.0  # the fake server sends one event per token
    assert on_disk["p50_ttft_ms"] == pytest.approx(on_disk["median_ttft_ms"])


def test_library_text_prompts_burst(tokenizer_dir):
    import argparse

    with FakeServer() as srv:
        args = argparse.Namespace(
            base_url=srv.url,
            model="fake-model",
            tokenizer=tokenizer_dir,
            num_prompts=5,
            random_input_len=12,
            random_output_len=4,
            prompt_format="text",
            num_warmups=0,
            disable_tqdm=True,
        )
        res = asyncio.run(bs.run_benchmark(args))
        bodies = srv.bodies
    _check_result(res, 5)
    assert res["failed"] == 0 and res["request_rate"] == "inf" and res["max_concurrency"] is None
    assert res["max_concurrent_requests"] == 5  # all sent at once
    assert all(isinstance(b["prompt"], str) for b in bodies)
    assert res["total_input_tokens"] == 5 * 12  # text re-encodes to exactly the asked length
    assert res["total_output_tokens"] == 5 * 4


def test_tokenizer_none_vocab_size():
    with FakeServer() as srv:
        res = bs.main(
            [
                "--base-url",
                srv.url,
                "--tokenizer",
                "none",
                "--vocab-size",
                "50",
                "--num-prompts",
                "3",
                "--random-input-len",
                "5",
                "--random-output-len",
                "3",
                "--disable-tqdm",
                "--num-warmups",
                "0",
            ]
        )
        prompts = [b["prompt"] for b in srv.bodies]
    _check_result(res, 3)
    assert all(len(p) == 5 and max(p) < 50 for p in prompts)


def _tokenizerless_run(url: str, *extra: str) -> dict:
    args = ["--base-url", url, "--num-prompts", "2", "--random-input-len", "6", "--random-output-len", "2",
            "--disable-tqdm", "--num-warmups", "0", *extra]
    return bs.main(args)


def test_tokenizer_from_the_local_servers_model_path(tokenizer_dir):
    """The quick-start case: no --tokenizer, and the served name is not a loadable path; the model folder
    comes from /server_info, since the server runs on this host."""
    captured = {"cuda_graph_bs": [1, 2, 4], "memory": {"num_slots": 1234}}
    with FakeServer(server_info={"args": {"model_path": tokenizer_dir}, "scheduler_info": captured}) as srv:
        res = _tokenizerless_run(srv.url)
        prompts = [b["prompt"] for b in srv.bodies]
    assert res["tokenizer"] == tokenizer_dir and res["failed"] == 0
    assert res["server_scheduler_info"] == captured  # the numbers carry what the server ran with
    vocab = bs.load_tokenizer(tokenizer_dir).get_vocab()
    assert all(len(p) == 6 and set(p) <= set(vocab.values()) for p in prompts), prompts
    # A folder that is not on this host, or a server elsewhere, is not used: the model name is tried.
    missing = {"args": {"model_path": tokenizer_dir + "-elsewhere"}}
    with FakeServer(server_info=missing) as srv, pytest.raises(SystemExit, match="could not load tokenizer '/no/"):
        _tokenizerless_run(srv.url, "--model", "/no/such/model")  # not a hub id either: fails at once
    assert bs._is_this_host("http://127.0.0.1:30000") and bs._is_this_host("http://localhost:1")
    assert not bs._is_this_host("http://10.11.12.13:30000")


def test_unreachable_server_records_failures(tokenizer_dir):
    # Nothing listens on this port: every request fails, none crashes the run.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.warns(UserWarning):
        res = bs.main(
            [
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--model",
                "m",
                "--tokenizer",
                tokenizer_dir,
                "--num-prompts",
                "3",
                "--random-input-len",
                "4",
                "--random-output-len",
                "2",
                "--disable-tqdm",
                "--num-warmups",
                "0",
            ]
        )
    assert res["completed"] == 0 and res["failed"] == 3
    assert all("ConnectError" in e for e in res["errors"])


# --------------------------------------------------------------------------------------------
# plot.py
# --------------------------------------------------------------------------------------------


def png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_serving_and_one_batch(tmp_path, monkeypatch):
    from benchmarks import plot

    plotted = []  # per saved figure: axes title -> line label -> (x, y) as drawn
    save = plot._save

    def capture(fig, out):
        plotted.append({ax.get_title(): {ln.get_label(): ([float(x) for x in ln.get_xdata()],
                                                          [float(y) for y in ln.get_ydata()]) for ln in ax.lines}
                        for ax in fig.axes})
        save(fig, out)

    monkeypatch.setattr(plot, "_save", capture)

    files, labels = [], []
    for label, scale in (("duet", 1.0), ("vllm", 0.8)):
        for rate in (1, 4, "inf"):
            r = 16.0 if rate == "inf" else float(rate)
            d = {
                "request_rate": rate,
                "label": label,
                "model": "m",
                "output_throughput": 100 * r * scale,
                "median_tpot_ms": 10 + r / scale,
                "p99_tpot_ms": 20 + 2 * r / scale,
            }
            p = tmp_path / f"{label}_{rate}.json"
            p.write_text(json.dumps(d))
            files.append(str(p))
            labels.append(label)
    out = tmp_path / "serving.png"
    plot.main(["serving", *files, "--labels", *labels, "--out", str(out)])
    assert png_size(out) == (12 * 120, int(4.5 * 120))  # figsize x dpi
    lines = plotted.pop()
    # "inf" is drawn right of the largest finite rate (x 1.25).
    assert lines["Output token throughput"]["duet"] == ([1, 4, 5], [100, 400, 1600])
    assert lines["Output token throughput"]["vllm"] == ([1, 4, 5], [80, 320, 1280])
    assert lines["TPOT p50 (solid) / p99 (dashed)"]["vllm p99"] == ([1, 4, 5], [22.5, 30, 60])
    groups = plot.group_serving(files)  # labels from the files
    assert list(groups) == ["duet", "vllm"] and [d["request_rate"] for d in groups["duet"]] == [1, 4, "inf"]

    ob = tmp_path / "one_batch.json"
    ob.write_text(
        json.dumps(
            {
                "model": "tiny",
                "results": [
                    {
                        "batch_size": b,
                        "eager_ms": 5 + b * 0.1,
                        "graph_ms": 2 + b * 0.08,
                        "floor_ms": 1.5 + b * 0.07,
                        "tokens_per_s": 1000.0,
                    }
                    for b in (1, 2, 4, 8, 16, 32)
                ]
                + [{"batch_size": 64, "eager_ms": 12.0, "graph_ms": None}],
            }
        )
    )
    out2 = tmp_path / "sub" / "one_batch.png"
    plot.main(["one-batch", str(ob), "--out", str(out2)])
    assert png_size(out2) == (7 * 120, int(4.5 * 120))
    (series,) = plotted.pop().values()  # one axes
    sizes = [1, 2, 4, 8, 16, 32]
    assert series["eager"] == (sizes + [64], [5 + b * 0.1 for b in sizes] + [12.0])
    assert series["graph"] == (sizes, [2 + b * 0.08 for b in sizes])  # the row without graph_ms is left out
    assert series["floor"][0] == sizes


def test_json_schema_ratio_marks_a_seeded_share():
    from benchmarks.bench_serving import SampledRequest, mark_json_schema

    reqs = [SampledRequest(prompt=[1, 2], prompt_len=2, output_len=4) for _ in range(10)]
    assert mark_json_schema(reqs, 0.5, seed=0) == 5
    marked = [i for i, r in enumerate(reqs) if r.extra_body]
    assert len(marked) == 5 and all(reqs[i].extra_body["response_format"]["type"] == "json_schema" for i in marked)
    again = [SampledRequest(prompt=[1, 2], prompt_len=2, output_len=4) for _ in range(10)]
    mark_json_schema(again, 0.5, seed=0)
    assert [i for i, r in enumerate(again) if r.extra_body] == marked
    with pytest.raises(ValueError):
        mark_json_schema(reqs, 1.5, seed=0)
