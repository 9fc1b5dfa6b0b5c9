"""A multimodal request's state in the scheduler: its images, M-RoPE positions, prefix-cache key and the image
embeddings it holds between prefill chunks; and an extend batch's MultimodalBatch built from them.

The vision encoder runs at extend time, once per image, for the images with tokens in the chunk whose
embeddings the request does not hold yet, across the batch, in one call of the tower (more where the model
runner's patch budget says so). A chunk may end
inside an image: the request keeps that image's embeddings until its last token is prefilled (a retracted
request drops them and encodes again).

Prefix cache: an image's pad tokens are all the same token id, so their KV would be shared by every image of the
same size. For the cache's keys only, each image's pad tokens are replaced by a value derived from the image's
content hash (SGLang's pad-value trick), negative, so it never equals a real token: the same image at the same
place is a cache hit, a different image of the same size is not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_executor.forward_batch import MultimodalBatch
from model_executor.models.qwen2_5_vl import mrope_positions
from scheduler.io_struct import ImageInput


class MultimodalError(ValueError):
    """A request's images do not fit its prompt or this model (the request's own fault: HTTP 400)."""


@dataclass
class MmState:
    images: list[ImageInput]
    positions: torch.Tensor  # [3, prompt tokens] int64, on the host
    delta: int  # decode position = text position + delta (HF's mrope_position_delta)
    cache_ids: list[int]  # the prompt with each image's pad tokens as its hash value
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> [num_tokens, H], on the device

    @classmethod
    def build(cls, input_ids: list[int], images: list[ImageInput], image_token_id: int | None,
              merge: int) -> MmState:
        if image_token_id is None:
            raise MultimodalError("this model takes no images")
        cache_ids = list(input_ids)
        at = 0
        for img in images:
            t, h, w = img.grid_thw
            end = img.offset + img.num_tokens
            if (img.offset < at or end > len(input_ids) or img.num_tokens != t * h * w // (merge * merge)
                    or any(x != image_token_id for x in input_ids[img.offset:end])):
                raise MultimodalError("the prompt's image tokens do not match its images")
            cache_ids[img.offset:end] = [-1 - (img.content_hash % (1 << 62))] * img.num_tokens
            at = end
        if input_ids.count(image_token_id) != sum(img.num_tokens for img in images):
            raise MultimodalError("the prompt has image tokens without an image")
        positions, delta = mrope_positions(input_ids, [(img.offset, img.grid_thw) for img in images], merge)
        return cls(images, positions, delta, cache_ids)

    def positions_of(self, start: int, n: int) -> torch.Tensor:
        """[3, n] positions of the tokens start .. start + n (prompt tokens: their M-RoPE positions; output tokens:
        text position + delta)."""
        prompt = self.positions.shape[1]
        head = self.positions[:, start:min(start + n, prompt)]
        if start + n <= prompt:
            return head
        tail = torch.arange(max(start, prompt), start + n).add_(self.delta).expand(3, -1)
        return torch.cat([head, tail], dim=1)

    def images_in(self, start: int, end: int) -> list[int]:
        """Indices of the images with tokens in start .. end."""
        return [i for i, img in enumerate(self.images) if img.offset < end and img.offset + img.num_tokens > start]

    def drop_done(self, kv_len: int) -> None:
        """Release the embeddings of images whose tokens are all prefilled."""
        for i in [i for i in self.embeds if self.images[i].offset + self.images[i].num_tokens <= kv_len]:
            del self.embeds[i]


def build_mm_batch(reqs: list, lens: list[int], starts: list[int], decoding: list[bool],
                   encode) -> MultimodalBatch | None:
    """The batch's MultimodalBatch (None when no request in it has images); encodes the images the chunk needs
    and no request holds yet, in one call: encode(pixel value arrays, grids) -> embeddings. starts: each request's
    KV length before the batch (a decoding request's one token is at position start)."""
    if not any(r.mm is not None for r in reqs):
        return None
    need = [(r, i) for r, n, s, dec in zip(reqs, lens, starts, decoding) if r.mm is not None and not dec
            for i in r.mm.images_in(s, s + n) if i not in r.mm.embeds]
    if need:
        imgs = [r.mm.images[i] for r, i in need]
        out = encode([torch.from_numpy(img.pixel_values) for img in imgs], [img.grid_thw for img in imgs])
        for (r, i), emb in zip(need, out):
            r.mm.embeds[i] = emb
    cols, rows, embeds, offset = [], [], [], 0
    for r, n, s, dec in zip(reqs, lens, starts, decoding):
        if r.mm is None:
            cols.append(torch.arange(s, s + n).expand(3, -1))
        elif dec:
            cols.append(torch.full((3, 1), s + r.mm.delta))
        else:
            cols.append(r.mm.positions_of(s, n))
            for i in r.mm.images_in(s, s + n):
                img = r.mm.images[i]
                lo, hi = max(img.offset, s), min(img.offset + img.num_tokens, s + n)
                rows.append(torch.arange(offset + lo - s, offset + hi - s))
                embeds.append(r.mm.embeds[i][lo - img.offset:hi - img.offset])
        offset += n
    positions = torch.cat(cols, dim=1)
    if not rows:
        return MultimodalBatch(positions)
    return MultimodalBatch(positions, torch.cat(rows), torch.cat(embeds))
