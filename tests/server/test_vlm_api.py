"""Images through the server on a tiny random Qwen2.5-VL (one module-scoped server): greedy tokens of chat
prompts with one and with two images equal HF transformers' generate, usage counts the image tokens, the same image
in a second request is a prefix-cache hit (a different image of the same size is not), Anthropic image blocks,
and bad images get a 400 naming the part while the server keeps serving."""

from __future__ import annotations

import base64
import http.server
import threading

import httpx
import pytest
import torch

from server.multimodal import ImageProcessor, ImageRef, parse_image_limit
from server.protocol import ApiError
from tests.fake_scheduler import ServerProcess
from tests.vlm_models import data_url, hf_inputs, make_image, save_tiny_qwen2_5_vl

NEW_TOKENS = 12
IMAGE_LIMIT = 3


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl_server")
    return path, save_tiny_qwen2_5_vl(path, model_dir, seed=3)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """The server's --allowed-local-media-path: one image, and a link that leads out of the folder."""
    path = tmp_path_factory.mktemp("media")
    (path / "cat.png").write_bytes(make_image(112, 84, 0))
    (path / "escape.png").symlink_to("/etc/hostname")
    return path


@pytest.fixture(scope="module")
def server(tiny_vl, media_dir):
    path, _ = tiny_vl
    srv = ServerProcess("--max-total-tokens", "4096", "--limit-mm-per-prompt", f"image={IMAGE_LIMIT}",
                        "--disable-image-url-fetch", "--chunked-prefill-size", "32",
                        "--allowed-local-media-path", str(media_dir), model_dir=path,
                        fake=False).wait_healthy(timeout=300)
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]


def chat(server, content: list[dict], **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "logprobs": True, "return_tokens_as_token_ids": True, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def token_ids(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return [int(t["token"].split(":")[1]) for t in resp.json()["choices"][0]["logprobs"]["content"]]


def image_part(data: bytes, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data), **extra}}


IMAGES = {"one_image": [(112, 84, 0)], "two_images": [(56, 56, 1), (140, 112, 2)]}


@pytest.mark.parametrize("name", list(IMAGES))
def test_greedy_tokens_equal_hf(server, tiny_vl, name):
    path, hf = tiny_vl
    images = [make_image(w, h, seed) for w, h, seed in IMAGES[name]]
    text = "Describe what you see."
    resp = chat(server, [*(image_part(b, detail="high") for b in images), {"type": "text", "text": text}])
    inputs = hf_inputs(path, images, text)
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert token_ids(resp) == ref[0, inputs["input_ids"].shape[1]:].tolist()
    assert resp.json()["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]  # image tokens included


def _cached(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return (resp.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_same_image_is_a_cache_hit_and_another_image_is_not(server):
    first, other = make_image(84, 84, 10), make_image(84, 84, 11)  # same size: the same number of pad tokens
    content = [{"type": "text", "text": "Look:"}, image_part(first), {"type": "text", "text": "What is it?"}]
    prompt_tokens = chat(server, content).json()["usage"]["prompt_tokens"]
    assert _cached(chat(server, content)) == prompt_tokens - 1  # everything but the last token
    content[1] = image_part(other)
    # only the text before the image: 9 merged tokens of another image are not a hit
    assert _cached(chat(server, content)) < prompt_tokens - 9 - 8


def test_anthropic_image_block_equals_the_chat_image_part(server):
    image = make_image(70, 98, 4)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": base64.b64encode(image).decode()}}
    body = {"messages": [{"role": "user", "content": [block, {"type": "text", "text": "Hi"}]}],
            "max_tokens": NEW_TOKENS, "temperature": 0.0}
    resp = httpx.post(f"{server.url}/v1/messages", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    ref = chat(server, [image_part(image), {"type": "text", "text": "Hi"}], ignore_eos=False, logprobs=False)
    assert reply["usage"]["input_tokens"] == ref.json()["usage"]["prompt_tokens"]
    text = "".join(b["text"] for b in reply["content"] if b["type"] == "text")
    assert text == ref.json()["choices"][0]["message"]["content"]


def _png(size: tuple[int, int]) -> bytes:
    return make_image(*size, seed=5)


BAD_PARTS = {
    "not base64": ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "base64"),
    "not an image": ({"type": "image_url", "image_url": {"url": data_url(b"hello world")}}, "cannot decode"),
    "broken png": ({"type": "image_url", "image_url": {"url": data_url(make_image(64, 64, 6)[:60])}},
                   "cannot decode"),
    "unsupported scheme": ({"type": "image_url", "image_url": {"url": "ftp://host/x.png"}}, "data: URL"),
    "url fetch disabled": ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}},
                           "--disable-image-url-fetch"),
    "file outside the media folder": ({"type": "image_url", "image_url": {"url": "file:///dev/zero"}},
                                      "not under --allowed-local-media-path"),
    "extreme aspect ratio": ({"type": "image_url", "image_url": {"url": data_url(make_image(3000, 10, 7))}},
                             "cannot be processed"),
    "unknown detail": ({"type": "image_url", "image_url": {"url": data_url(make_image(56, 56, 8)),
                                                           "detail": "ultra"}}, "detail"),
    "url not a string": ({"type": "image_url", "image_url": {"url": 5}}, "image_url.url"),
}


@pytest.mark.parametrize("case", list(BAD_PARTS))
def test_bad_image_is_a_400_naming_the_part(server, case):
    part, words = BAD_PARTS[case]
    resp = chat(server, [{"type": "text", "text": "see"}, part])
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "messages.0.content.1" and words in err["message"], err


def test_local_files_only_under_the_media_folder(server, media_dir):
    """file:// reads a regular file under --allowed-local-media-path (the same tokens as its data: URL); a missing
    file, a link leading out of the folder and the folder itself are 400s naming the part."""
    assert token_ids(chat(server, [{"type": "image_url", "image_url": {"url": f"file://{media_dir}/cat.png"}}])) == \
        token_ids(chat(server, [image_part(make_image(112, 84, 0))]))
    for name, words in (("missing.png", "cannot read"), ("escape.png", "not under"), ("", "not a regular file")):
        resp = chat(server, [{"type": "text", "text": "see"},
                             {"type": "image_url", "image_url": {"url": f"file://{media_dir}/{name}"}}])
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "messages.0.content.1" and words in err["message"], err


def test_too_many_images_and_too_many_pixels(server):
    parts = [image_part(make_image(56, 56, i)) for i in range(IMAGE_LIMIT + 1)]
    resp = chat(server, parts)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == f"messages.0.content.{IMAGE_LIMIT}"
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8000, 7000)).save(buf, format="PNG")  # 56 M pixels: refused before decoding
    resp = chat(server, [image_part(buf.getvalue())])
    assert resp.status_code == 400 and "pixels" in resp.json()["error"]["message"], resp.text
    resp = httpx.post(f"{server.url}/v1/messages", json={"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                    "data": "AAAA"}}]}]}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["message"].startswith("messages.0.content.1: "), resp.text


def test_fuzzed_image_parts_never_break_the_server(server):
    gen = torch.Generator().manual_seed(0)
    for i in range(12):
        junk = bytes(torch.randint(0, 256, (int(torch.randint(1, 400, (1,), generator=gen)),), generator=gen).tolist())
        if i % 3 == 0:  # a real PNG header with random data after it
            junk = make_image(32, 32, i)[:16] + junk
        url = [data_url(junk), "data:image/png;base64," + base64.b64encode(junk).decode()[:-1],
               "data:" + junk.hex(), f"file:///dev/{i}", ""][i % 5]
        resp = chat(server, [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}])
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages.0.content.1", resp.text
    assert token_ids(chat(server, [image_part(make_image(56, 56, 9))]))  # still serving


def test_limit_flag_parsing():
    assert parse_image_limit("image=4") == 4 and parse_image_limit('{"image": 2}') == 2
    assert parse_image_limit(None) > 0
    for bad in ("video=1", "image=x", "image", "{", "image=-1"):
        with pytest.raises(ValueError):
            parse_image_limit(bad)


def test_http_image_fetched_with_a_size_cap(tiny_vl, monkeypatch):
    path, _ = tiny_vl
    from transformers import AutoTokenizer

    import server.multimodal as mm

    payload = {"/small.png": make_image(56, 56, 1), "/big.png": b"x" * 2048}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = payload.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        proc = ImageProcessor.load(str(path), AutoTokenizer.from_pretrained(path), 4)
        assert proc.fetch(ImageRef(base + "/small.png", "p")) == payload["/small.png"]
        monkeypatch.setattr(mm, "URL_FETCH_MAX_BYTES", 1024)
        with pytest.raises(ApiError, match="larger than"):
            proc.fetch(ImageRef(base + "/big.png", "p"))
        with pytest.raises(ApiError, match="cannot fetch"):
            proc.fetch(ImageRef(base + "/missing.png", "p"))
    finally:
        httpd.shutdown()


def test_tokenize_counts_the_image_tokens(server):
    content = [image_part(make_image(56, 84, 12)), {"type": "text", "text": "Count me."}]
    usage = chat(server, content).json()["usage"]
    resp = httpx.post(f"{server.url}/v1/tokenize", json={"messages": [{"role": "user", "content": content}]},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["count"] == usage["prompt_tokens"]


def test_responses_input_image_equals_the_chat_image_part(server):
    image = make_image(84, 56, 13)
    body = {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Hi"}, {"type": "input_image", "image_url": data_url(image), "detail": "low"}]}],
        "max_output_tokens": NEW_TOKENS, "temperature": 0.0}
    resp = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    ref = chat(server, [{"type": "text", "text": "Hi"}, image_part(image)], ignore_eos=False, logprobs=False)
    assert resp.json()["usage"]["input_tokens"] == ref.json()["usage"]["prompt_tokens"]
    assert resp.json()["output"][0]["content"][0]["text"] == ref.json()["choices"][0]["message"]["content"]
    bad = {**body, "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                          {"type": "input_image", "image_url": data_url(b"no")}]}]}
    resp = httpx.post(f"{server.url}/v1/responses", json=bad, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input.0.content.1", resp.text


def test_pixel_bounds_set_the_image_tokens(tiny_vl):
    path, _ = tiny_vl
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ref = ImageRef(data_url(make_image(224, 168, 14)), "p")
    default = ImageProcessor.load(str(path), tok, 4).load_images([ref])[0].num_tokens
    small = ImageProcessor.load(str(path), tok, 4, max_pixels=28 * 28 * 4).load_images([ref])[0].num_tokens
    big = ImageProcessor.load(str(path), tok, 4, min_pixels=28 * 28 * 60, max_pixels=28 * 28 * 64)
    assert small <= 4 < default < big.load_images([ref])[0].num_tokens


def test_bad_image_flags_are_refused():
    from server.args import ArgsError, ServerArgs

    for kwargs in ({"limit_mm_per_prompt": "video=2"}, {"mm_min_pixels": 0},
                   {"mm_min_pixels": 5000, "mm_max_pixels": 4000}, {"allowed_local_media_path": "/nonexistent"}):
        with pytest.raises(ArgsError, match="--(limit-mm-per-prompt|mm-min-pixels|allowed-local-media-path)"):
            ServerArgs(**kwargs).validate()
