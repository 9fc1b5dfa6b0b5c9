"""Images in prompts (vision-language models): fetching and decoding them, the model's own image processor, and
the prompt's image tokens. Runs in the HTTP process (the tokenizer manager's); the scheduler gets each image's
pixel values and grid, and the prompt with its pad tokens expanded (io_struct.ImageInput).

An image is a `data:` URL (base64), a `file://` path under --allowed-local-media-path (refused without it), or
an http(s) URL fetched with a timeout and a size cap (refused with --disable-image-url-fetch). The chat template writes each image as the model's vision tokens with
one pad token; the pad token is then repeated once per embedding the vision tower gives the image
(grid t * h * w / merge**2), as HF's processor does. Every failure is an ApiError(400) naming the part.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from scheduler.io_struct import ImageInput
from server.protocol import ApiError

# The architectures whose prompts may hold images, with their image pad token.
VISION_ARCHITECTURES = {"Qwen2_5_VLForConditionalGeneration": "<|image_pad|>"}
DEFAULT_IMAGE_LIMIT = 8  # images per request unless --limit-mm-per-prompt says otherwise
URL_FETCH_TIMEOUT_S = 10.0
URL_FETCH_MAX_BYTES = 20 * 1024 * 1024
MAX_DECODED_PIXELS = 50_000_000  # an image larger than this (before resizing) is refused, not decoded


@dataclass(frozen=True)
class ImageRef:
    """An image part of a request: its URL and where it is in the request (the 400's param)."""

    url: str
    where: str


def parse_image_limit(value: str | None) -> int:
    """--limit-mm-per-prompt: `image=N` (vLLM's older form) or JSON `{"image": N}`; ValueError otherwise."""
    if value is None:
        return DEFAULT_IMAGE_LIMIT
    text = value.strip()
    if text.startswith("{"):
        try:
            limits = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e})") from None
    else:
        limits = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, num = item.partition("=")
            if not sep:
                raise ValueError(f"expected image=N, got {item!r}")
            limits[key.strip()] = num.strip()
    if set(limits) != {"image"}:
        raise ValueError(f"only the image modality is served, got {sorted(limits)}")
    try:
        n = int(limits["image"])
    except (TypeError, ValueError):
        raise ValueError(f"the image limit must be an integer, got {limits['image']!r}") from None
    if n < 0:
        raise ValueError(f"the image limit must be >= 0, got {n}")
    return n


class ImageProcessor:
    """The model's image processor (transformers' AutoImageProcessor from the model folder) with the server's
    limits. `load` returns None for a text-only model."""

    def __init__(self, processor, image_token: str, image_token_id: int, merge: int, max_images: int,
                 allow_url_fetch: bool, local_media_path: str | None = None):
        self.processor = processor
        self.image_token = image_token
        self.image_token_id = image_token_id
        self.merge = merge
        self.max_images = max_images
        self.allow_url_fetch = allow_url_fetch
        # file:// images are read from under this folder only (None: refused)
        self.local_media_path = Path(local_media_path).resolve() if local_media_path else None

    @classmethod
    def load(cls, model_path: str, tokenizer, max_images: int, min_pixels: int | None = None,
             max_pixels: int | None = None, allow_url_fetch: bool = True,
             local_media_path: str | None = None) -> ImageProcessor | None:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        arch = next((a for a in cfg.get("architectures") or [] if a in VISION_ARCHITECTURES), None)
        if arch is None:
            return None
        import transformers

        kwargs = {}
        if min_pixels is not None or max_pixels is not None:
            base = transformers.AutoImageProcessor.from_pretrained(model_path).size
            kwargs["size"] = {"shortest_edge": min_pixels or base["shortest_edge"],
                              "longest_edge": max_pixels or base["longest_edge"]}
        processor = transformers.AutoImageProcessor.from_pretrained(model_path, **kwargs)
        token = VISION_ARCHITECTURES[arch]
        token_id = cfg.get("image_token_id", tokenizer.convert_tokens_to_ids(token))
        merge = int(cfg.get("vision_config", {}).get("spatial_merge_size", 2))
        return cls(processor, token, token_id, merge, max_images, allow_url_fetch, local_media_path)

    # ---- images in ------------------------------------------------------------------------------------

    def check_count(self, refs: list[ImageRef]) -> None:
        if len(refs) > self.max_images:
            raise ApiError(400, f"this request has {len(refs)} images; the server takes at most {self.max_images} "
                                "per request (--limit-mm-per-prompt)", refs[self.max_images].where)

    def fetch(self, ref: ImageRef) -> bytes:
        """The image's bytes from its URL."""
        url = ref.url
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            head, sep, payload = url.partition(",")
            if not sep or not head.endswith(";base64"):
                raise ApiError(400, "a data: image URL must be base64 (data:image/png;base64,...)", ref.where)
            try:
                return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(400, "the data: image URL is not valid base64", ref.where) from None
        if scheme == "file":
            return self._read_local(Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)), ref.where)
        if scheme in ("http", "https"):
            if not self.allow_url_fetch:
                raise ApiError(400, "http(s) image URLs are refused by this server (--disable-image-url-fetch); "
                                    "send the image as a data: URL", ref.where)
            try:
                with urllib.request.urlopen(url, timeout=URL_FETCH_TIMEOUT_S) as resp:  # (scheme checked)
                    data = resp.read(URL_FETCH_MAX_BYTES + 1)
            except Exception as e:  # noqa: BLE001 - any network failure is the URL's
                raise ApiError(400, f"cannot fetch the image URL: {e}", ref.where) from None
            if len(data) > URL_FETCH_MAX_BYTES:
                raise ApiError(400, f"the image at the URL is larger than {URL_FETCH_MAX_BYTES} bytes", ref.where)
            return data
        raise ApiError(400, "an image URL must be a data: URL (base64), a file:// path or an http(s) URL",
                       ref.where)

    def _read_local(self, path: Path, where: str) -> bytes:
        """A file:// image: a regular file under --allowed-local-media-path (links resolved first), at most
        URL_FETCH_MAX_BYTES."""
        if self.local_media_path is None:
            raise ApiError(400, "file:// image paths are refused by this server (start it with "
                                "--allowed-local-media-path DIR to read images from DIR)", where)
        try:
            real = path.resolve(strict=True)
            if not real.is_relative_to(self.local_media_path):
                raise ApiError(400, f"the image file {str(path)!r} is not under --allowed-local-media-path", where)
            if not real.is_file():
                raise ApiError(400, f"the image path {str(path)!r} is not a regular file", where)
            if real.stat().st_size > URL_FETCH_MAX_BYTES:
                raise ApiError(400, f"the image file is larger than {URL_FETCH_MAX_BYTES} bytes", where)
            return real.read_bytes()
        except OSError as e:
            raise ApiError(400, f"cannot read the image file {str(path)!r}: {e.strerror or e}", where) from None

    def decode(self, data: bytes, where: str):
        """A PIL image in RGB."""
        from PIL import Image

        try:
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > MAX_DECODED_PIXELS:
                raise ApiError(400, f"the image has {w} x {h} pixels, more than the {MAX_DECODED_PIXELS} this server "
                                    "decodes", where)
            img.load()
            return img.convert("RGB")
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - PIL raises many kinds for unreadable data
            raise ApiError(400, f"cannot decode the image (unsupported format or broken data: {type(e).__name__})",
                           where) from None

    def load_images(self, refs: list[ImageRef]) -> list[ImageInput]:
        """Fetch, decode and process the images (blocking: run it off the event loop); their ImageInputs with
        offsets not yet set."""
        self.check_count(refs)
        images = [self.decode(self.fetch(ref), ref.where) for ref in refs]
        out = []
        for img, ref in zip(images, refs):
            try:
                res = self.processor(images=[img], return_tensors="np")
            except ValueError as e:  # e.g. an aspect ratio the resize cannot keep
                raise ApiError(400, f"the image cannot be processed: {e}", ref.where) from None
            pixels = res["pixel_values"]
            t, h, w = (int(x) for x in res["image_grid_thw"][0])
            digest = hashlib.sha256(pixels.tobytes())
            digest.update(f"{t},{h},{w}".encode())
            out.append(ImageInput(pixels, (t, h, w), -1, t * h * w // (self.merge * self.merge),
                                  int.from_bytes(digest.digest()[:8], "little")))
        return out

    # ---- the prompt -------------------------------------------------------------------------------------

    def expand(self, text: str, images: list[ImageInput], encode) -> tuple[list[int], list[ImageInput]]:
        """The rendered prompt text (one pad token per image, where the chat template put it) as token ids
        with each image's pad tokens repeated, and the images with their offsets. encode: text -> ids."""
        pieces = text.split(self.image_token)
        if len(pieces) != len(images) + 1:
            raise ApiError(400, f"the prompt has {len(pieces) - 1} image placeholders for {len(images)} images "
                                f"(the text may not contain {self.image_token!r} itself)", "messages")
        ids: list[int] = []
        placed = []
        for i, piece in enumerate(pieces):
            ids += encode(piece)
            if i < len(images):
                img = images[i]
                placed.append(ImageInput(img.pixel_values, img.grid_thw, len(ids), img.num_tokens,
                                         img.content_hash))
                ids += [self.image_token_id] * img.num_tokens
        return ids, placed
