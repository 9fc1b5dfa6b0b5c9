"""A tiny random Qwen2.5-VL saved by HF transformers, with its processor in the same folder (the default model's
tokenizer with Qwen's vision tokens added), and the test images."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's chat layout: a string content as it is, a list of parts with each image as its vision tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The processor's pixel bounds: images are resized to between 4 and 64 merged tokens.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 64


def tiny_config(vocab_size: int, ids: dict[str, int]) -> dict:
    text = {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": 1, "eos_token_id": 2}
    vision = {"depth": 4, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
              "fullatt_block_indexes": [2], "in_channels": 3, "tokens_per_second": 2}
    return {"text_config": text, "vision_config": vision, "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"], "tie_word_embeddings": False}


def save_tiny_qwen2_5_vl(path: Path, tokenizer_dir: Path, seed: int = 0):
    """Save a random Qwen2.5-VL (float32) and its processor to path; returns the HF model (eval)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    vocab = (len(tok) + 63) // 64 * 64
    cfg = transformers.Qwen2_5_VLConfig(**tiny_config(vocab, ids))
    cfg.text_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():  # HF's default init is tiny; widen it so logits differ meaningfully
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    # (the Pillow backend: torchvision, the default backend's, is not a dependency)
    image_processor = getattr(transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor)(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                                            patch_size=14, merge_size=2, temporal_patch_size=2)
    image_processor.save_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return model.eval()


def make_image(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    """A random RGB image, encoded."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def hf_inputs(path: Path, images: list[bytes], text: str) -> dict:
    """HF's inputs for a one-message chat of the images then the text: the template's ids with each image's pad
    token repeated once per merged patch block (what HF's processor does), pixel_values, image_grid_thw and
    mm_token_type_ids (1 at image tokens: what makes HF's generate use M-RoPE positions)."""
    import transformers
    from PIL import Image

    tok = transformers.AutoTokenizer.from_pretrained(path)
    proc = transformers.AutoImageProcessor.from_pretrained(path)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                     tokenize=False)
    out = proc(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")
    pad = "<|image_pad|>"
    pieces = prompt.split(pad)
    assert len(pieces) == len(images) + 1
    for i, (t, h, w) in enumerate(out["image_grid_thw"].tolist()):
        pieces[i] += pad * (t * h * w // 4)
    ids = tok("".join(pieces), add_special_tokens=False, return_tensors="pt")["input_ids"]
    pad_id = tok.convert_tokens_to_ids(pad)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"], "mm_token_type_ids": (ids == pad_id).int()}


def image_inputs(inputs: dict, pad_id: int) -> list:
    """hf_inputs' images as the scheduler's ImageInputs (content hash: of the pixel values)."""
    import hashlib

    from scheduler.io_struct import ImageInput

    ids = inputs["input_ids"][0].tolist()
    grids = inputs["image_grid_thw"].tolist()
    pixels = inputs["pixel_values"].numpy()
    out, row, at = [], 0, 0
    for t, h, w in grids:
        n = t * h * w // 4
        offset = ids.index(pad_id, at)
        px = pixels[row:row + t * h * w]
        digest = int.from_bytes(hashlib.sha256(px.tobytes()).digest()[:8], "little")
        out.append(ImageInput(px.copy(), (t, h, w), offset, n, digest))
        row += t * h * w
        at = offset + n
    return out
