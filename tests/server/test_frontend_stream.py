"""The HTTP process's stream path under load: engine messages that queued while it was busy are read in one
wake-up and each stream's tokens go out as one event, with nothing lost on the way (prompt logprobs)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import zmq

from model_executor.sampling_params import SamplingParams
from scheduler.io_struct import BatchStrOut, FinishReason, PromptLogprobs
from scheduler.ipc import IpcPaths, bind_pull
from server.metrics import ServerMetrics
from server.serving_common import ChoiceChunks, sse
from server.tokenizer_manager import GenRequest, TokenizerManager, _coalesce, _Fragment


class _Tok:
    def __len__(self):
        return 100


def _out(rid: str, text: str, token: int, n: int, finish=None) -> BatchStrOut:
    return BatchStrOut(rids=[rid], text_deltas=[text], new_token_ids=[[token]], finished=[finish],
                       prompt_tokens=[3], completion_tokens=[n], cached_tokens=[0], logprobs=[])


def _run_with_engine(script):
    """script(tm, scheduler, engine) against a started TokenizerManager: `scheduler` receives what it sends to
    the engine, `engine` sends it engine messages. Returns the script's result."""
    ipc = IpcPaths.create()
    ctx = zmq.Context()
    try:
        scheduler = bind_pull(ctx, ipc.scheduler_input)
        engine = ctx.socket(zmq.PUSH)
        engine.connect(ipc.http_input)

        async def main():
            tm = TokenizerManager(_Tok(), ipc, {"context_len": 64, "num_kv_slots": 1000, "vocab_size": 100},
                                  ServerMetrics())
            await tm.start()
            try:
                return await script(tm, scheduler, engine)
            finally:
                await tm.stop()

        return asyncio.run(main())
    finally:
        ctx.destroy(linger=0)
        ipc.remove()


def test_messages_queued_while_the_loop_was_busy_reach_a_stream_as_one_chunk():
    async def script(tm, scheduler, engine):
        gen = tm.generate([GenRequest([1, 2, 3], SamplingParams(max_new_tokens=3))], "c")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)  # the request is sent; the stream waits for output
        rid = scheduler.recv_pyobj().rid
        engine.send_pyobj(_out(rid, " a", 7, 1))
        engine.send_pyobj(_out(rid, " b", 8, 2))
        engine.send_pyobj(_out(rid, " c", 9, 3, FinishReason("length")))
        time.sleep(0.3)  # noqa: ASYNC251 - the event loop is kept busy while all three arrive
        return [await first] + [c async for c in gen]

    chunks = _run_with_engine(script)
    assert [(c.text, c.token_ids, c.finish and c.finish.kind) for c in chunks] == [(" a b c", [7, 8, 9], "length")]


class _Spin(BaseException):
    """Raised by the fake socket once the read loop has retried it too often (ends the loop, fails the test)."""


def test_a_failing_drain_does_not_spin_the_read_loop():
    """A non-EAGAIN error from the non-blocking drain (e.g. a closed socket) ends that drain: the loop goes back
    to awaiting the engine instead of retrying the broken read forever inside one wake-up."""
    calls = []

    def broken_recv(*args):
        calls.append(args)
        if len(calls) > 50:
            raise _Spin()
        raise RuntimeError("socket gone")

    async def script(tm, scheduler, engine):
        tm._pull_now.recv_pyobj = broken_recv
        gen = tm.generate([GenRequest([1, 2, 3], SamplingParams(max_new_tokens=1))], "c")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        rid = scheduler.recv_pyobj().rid
        engine.send_pyobj(_out(rid, " a", 7, 1, FinishReason("length")))
        return await asyncio.wait_for(first, 5)

    chunk = _run_with_engine(script)
    assert chunk.text == " a" and len(calls) == 1


def test_coalesced_fragments_keep_the_prompt_logprobs_of_the_first_output():
    st = object()
    lps = PromptLogprobs(first=1, token_ids=[5, 6], logprobs=[-1.0, -2.0], ranks=[1, 2])
    first = _Fragment(" a", [7], None, None, 3, 1, 0, prompt_logprobs=lps)
    (merged,) = _coalesce([(st, first), (st, _Fragment(" b", [8], None, None, 3, 2, 0))])
    assert (merged[1].text, merged[1].prompt_logprobs) == (" a b", lps)


@pytest.mark.parametrize("fields", [
    {"text": "plain", "logprobs": None, "finish_reason": None},
    {"text": 'quote " back\\slash \n newline \u2028 é 😀 \x00', "logprobs": None, "finish_reason": "stop"},
    {"text": "", "logprobs": {"tokens": ["a", "é"], "token_logprobs": [-0.5, float("-inf")],
                              "top_logprobs": [{"a": -0.5}, None], "text_offset": [0, 1]}, "finish_reason": "length"},
    {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\": 1}"}}]},
     "logprobs": {"content": []}, "finish_reason": "tool_calls"},
])
def test_choice_chunks_write_exactly_what_sse_of_the_dict_writes(fields):
    chunks = ChoiceChunks('cmpl-"1"', "text_completion", 1700000000, "my/model é")
    expected = sse({"id": 'cmpl-"1"', "object": "text_completion", "created": 1700000000, "model": "my/model é",
                    "choices": [{"index": 3, **fields}], "usage": None})
    assert chunks(3, fields) == expected


def test_sse_data_lines_survive_readers_that_split_on_unicode_line_breaks():
    """Text with U+0085, U+2028 or U+2029 (a byte-level BPE can put them in a stream) goes out as \\u escapes:
    a reader that splits as str.splitlines does (httpx's aiter_lines) gets one data line per event, whose JSON
    holds the text unchanged."""
    from httpx._decoders import LineDecoder

    text = "a\x85b\u2028c\u2029d é \n"
    chunks = ChoiceChunks("cmpl-1", "text_completion", 1700000000, "m\u2028")
    for event in (sse({"text": text}), chunks(0, {"text": text, "finish_reason": None})):
        lines = [line for line in LineDecoder().decode(event) if line]
        assert len(lines) == 1 and lines[0].startswith("data: ")
        body = json.loads(lines[0][6:])
        assert (body.get("text") or body["choices"][0]["text"]) == text
