"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a vision tower in front of the Qwen2 decoder.

The vision tower turns each image's patches (the image processor's pixel_values: one row of
channels x temporal_patch x patch x patch values per patch) into one embedding per merged 2 x 2 patch block:
- patch embed: HF's Conv3d with kernel == stride, i.e. a linear layer over each patch row;
- `depth` blocks of RMSNorm -> attention (2-D rotary over the patch's (h, w)) -> RMSNorm -> gated SiLU MLP, each
  attending within windows of window_size pixels, except the blocks at fullatt_block_indexes, which attend
  over the whole image (every block keeps images apart); the tokens run in window order (HF's window index),
  which the merger's output undoes;
- the patch merger: RMSNorm, then an MLP over each block of spatial_merge_size**2 patches.
The embeddings replace the image pad tokens of the prompt; the language model (llama.py's Qwen2 layers) turns
q and k with M-RoPE: an image token's position is (t, h, w) of its merged block, a text token's (p, p, p),
and mrope_section splits the rotary dims among the three (MRotaryEmbedding). Decode positions are the text
position plus the request's mrope_position_delta, which this model keeps per request row (`mrope_deltas`,
set by the model runner at extend): decode batches carry 1-D positions only.

The positions of a prompt (`mrope_positions`) follow HF's get_rope_index for images. Checkpoint names are HF's:
`model.visual.*`, `model.language_model.*` (transformers 5; `visual.*` and `model.*` in transformers 4
checkpoints), `lm_head.*`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.logits import compute_logits
from model_executor.layers.norm import RMSNorm
from model_executor.layers.rotary import RotaryEmbedding, _rotate
from model_executor.model_config import ModelConfig
from model_executor.models.llama import LlamaForCausalLM, LlamaModel


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: positions [3, T] (t, h, w) turn the rotary dims in sections, section i by axis i % 3; 1-D
    positions [T] (every axis equal: text, decode) are the plain rotary, fused kernels included."""

    def __init__(self, *args, mrope_section: Sequence[int], **kwargs):
        super().__init__(*args, **kwargs)
        if sum(mrope_section) * 2 != self.head_dim:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to half the head dim {self.head_dim}")
        self.axis = [i % 3 for i, n in enumerate(mrope_section) for _ in range(n)] * 2
        # which axis each column of a cos_sin row comes from (its cos half, then its sin half)
        self.register_buffer("axis_of_dim", torch.tensor(self.axis, dtype=torch.int64), persistent=False)

    @torch.no_grad()
    def init_cache(self) -> None:
        super().init_cache()
        self.axis_of_dim = torch.tensor(self.axis, dtype=torch.int64, device=self.cos_sin_cache.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        rows = self.cos_sin_cache[positions]  # [3, T, D]
        idx = self.axis_of_dim.view(1, 1, -1).expand(1, rows.shape[1], -1)
        cos, sin = rows.gather(0, idx).squeeze(0).unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


class Qwen2_5_VLTextModel(LlamaModel):
    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        served = cfg.served_context_len
        return MRotaryEmbedding(cfg.head_dim, max(cfg.max_position_embeddings, served or 0), cfg.rope_theta,
                                cfg.rope_scaling, original_max_position=cfg.max_position_embeddings, seq_len=served,
                                mrope_section=cfg.mrope_section)


# ---- the vision tower ------------------------------------------------------------------------------------


def _vision_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary in float32 (cos, sin: [T, 1, D])."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, segments: list[torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """x [T, dim]; segments: the token indices [n, L] of n segments of L tokens (windows or images) that
        attend among themselves, one tensor per length (Segments)."""
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _vision_rotate(q, cos, sin), _vision_rotate(k, cos, sin)
        out = torch.empty_like(q)
        for idx in segments:  # [n, L, H, D] -> [n, H, L, D]: n segments of one length in one call
            o = F.scaled_dot_product_attention(q[idx].transpose(1, 2), k[idx].transpose(1, 2),
                                               v[idx].transpose(1, 2))
            out[idx] = o.transpose(1, 2)
        return self.proj(out.reshape(t, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        if act != "silu":
            raise ValueError(f"vision_config hidden_act {act!r} is not supported (silu)")
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        dim = vc["hidden_size"]
        self.norm1 = RMSNorm(dim, 1e-6)
        self.norm2 = RMSNorm(dim, 1e-6)
        self.attn = VisionAttention(dim, vc["num_heads"])
        self.mlp = VisionMLP(dim, vc["intermediate_size"], vc.get("hidden_act", "silu"))

    def forward(self, x, segments, cos, sin):
        x = x + self.attn(self.norm1(x), segments, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """HF's Conv3d (kernel == stride) as a linear layer over each patch row; the weight keeps the conv's shape."""

    def __init__(self, vc: dict):
        super().__init__()
        tp, p = vc["temporal_patch_size"], vc["patch_size"]
        self.embed_dim = vc["hidden_size"]
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(self.embed_dim, vc.get("in_channels", 3), tp, p, p),
                                        requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.view(self.embed_dim, -1))


class PatchMerger(nn.Module):
    def __init__(self, dim: int, context_dim: int, merge: int):
        super().__init__()
        self.hidden = context_dim * merge * merge
        self.ln_q = RMSNorm(context_dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        self.merge = vc["spatial_merge_size"]
        self.patch_size = vc["patch_size"]
        self.window_size = vc["window_size"]
        self.fullatt = set(vc["fullatt_block_indexes"])
        self.rotary_dim = vc["hidden_size"] // vc["num_heads"] // 2  # each of h and w turns half the head
        self.theta = float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.patch_embed = PatchEmbed(vc)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc["depth"]))
        self.merger = PatchMerger(vc["out_hidden_size"], vc["hidden_size"], self.merge)

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [patches, C*Tp*P*P] of the images in grid_thw, in order -> [merged tokens, out_hidden]."""
        device = pixels.device
        unit = self.merge * self.merge
        window_index, window_bounds, frame_bounds, pos = _layout(grid_thw, self.merge,
                                                                 self.window_size // self.merge // self.patch_size)
        window_index = window_index.to(device)
        x = self.patch_embed(pixels)
        n = x.shape[0]

        def window_order(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(n // unit, unit, -1)[window_index].reshape(n, -1)

        x = window_order(x)
        pos = pos.to(device)  # [n, 2] (h, w)
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device=device)
                                        / self.rotary_dim)
        freqs = (pos[..., None].float() * inv_freq).flatten(1)  # [n, head_dim / 2]
        freqs = window_order(torch.cat([freqs, freqs], dim=-1))
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
        # Attention stays within each window (each image, in the full-attention blocks); in window order an
        # image's tokens are contiguous, and so are a window's.
        images = _segments(frame_bounds, device)
        windows = _segments(window_bounds, device)
        for i, block in enumerate(self.blocks):
            x = block(x, images if i in self.fullatt else windows, cos, sin)
        merged = self.merger(x)
        return merged[torch.argsort(window_index)]


def _layout(grid_thw: list[tuple[int, int, int]], merge: int,
            window: int) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """The vision tower's token layout for images of these grids (HF's window index, cu_seqlens and position ids):
    - the window order: the merged blocks (merge x merge patches) of each frame by windows of window x window
      blocks (row by row; the windows at the right and bottom edges may be smaller), block by block inside;
    - the boundaries, in patches, of the windows and of the frames (in window order too);
    - each patch's (h, w) position, in the processor's order (block by block, the patches of a block in rows)."""
    order, window_bounds, frame_bounds, pos = [], [0], [0], []
    first, unit = 0, merge * merge
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        blocks = torch.arange(t * gh * gw).view(t, gh, gw) + first
        for f in range(t):
            for y in range(0, gh, window):
                for x in range(0, gw, window):
                    ids = blocks[f, y:y + window, x:x + window].flatten()
                    order.append(ids)
                    window_bounds.append(window_bounds[-1] + ids.numel() * unit)
            frame_bounds.append(frame_bounds[-1] + h * w)
        first += t * gh * gw
        hh = torch.arange(h).view(gh, merge, 1, 1).expand(gh, merge, gw, merge).transpose(1, 2).flatten()
        ww = torch.arange(w).view(1, 1, gw, merge).expand(gh, merge, gw, merge).transpose(1, 2).flatten()
        pos.append(torch.stack([hh, ww], dim=-1).repeat(t, 1))
    return torch.cat(order), window_bounds, frame_bounds, torch.cat(pos)


def _segments(bounds: list[int], device) -> list[torch.Tensor]:
    """Segments given by their boundaries, as token indices grouped by length: one [n, L] tensor per length L."""
    by_len: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(bounds):
        if end > start:
            by_len.setdefault(end - start, []).append(start)
    return [(torch.tensor(starts)[:, None] + torch.arange(n)).to(device) for n, starts in by_len.items()]


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    supports_tensor_parallel = False  # (the vision tower is not sharded)
    # mrope positions for a prompt with images, and the image tokens' ids: what the scheduler needs
    uses_mrope = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        vc = cfg.hf_config["vision_config"]
        self.visual = Qwen2_5_VisionTransformer(vc)
        # Each request row's mrope_position_delta (decode positions are text position + delta); the model
        # runner sizes it for its request rows and writes a row's delta when the request's extend runs.
        self.register_buffer("mrope_deltas", torch.zeros(1, dtype=torch.int64), persistent=False)

    def make_backbone(self, cfg: ModelConfig) -> LlamaModel:
        return Qwen2_5_VLTextModel(cfg, self.decoder_layer)

    @torch.inference_mode()
    def encode_images(self, pixels: list[torch.Tensor], grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Each image's embeddings [its tokens, hidden], from one pass of the vision tower over them all."""
        device = self.lm_head.weight.device
        merged = self.visual(torch.cat(pixels).to(device, non_blocking=True), grid_thw)
        unit = self.visual.merge ** 2
        return list(merged.split([t * h * w // unit for t, h, w in grid_thw]))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        embeds = None
        if fb.mode.is_decode():
            # (the rows of the tokens given: a compiled decode's traced batch may hold more rows than it runs)
            positions = positions + self.mrope_deltas[fb.req_pool_indices[: positions.shape[0]]]
        elif fb.mm is not None:
            positions = fb.mm.positions
            if fb.mm.embed_rows is not None:
                embeds = self.model.embed_tokens(input_ids)
                embeds[fb.mm.embed_rows] = fb.mm.embeds.to(embeds.dtype)
        head = self.lm_head if fb.mode.is_decode() and fb.prompt_logprob_plan is None else None
        return compute_logits(self.lm_head, self.model(input_ids, positions, fb, head, input_embeds=embeds), fb)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_our_names(weights))

    def _expected_shards(self, name: str, owner: nn.Module) -> set[str]:
        if name.startswith("visual."):
            return {name}
        return super()._expected_shards(name, owner)

    def checkpoint_name(self, name: str) -> str:
        if name.startswith("visual."):
            return "model." + name
        target = super().checkpoint_name(name)
        return "model.language_model." + target[len("model."):] if target.startswith("model.") else target

    def _fused_target(self, name: str) -> tuple[str, object]:
        if name.startswith("visual."):
            return name, None
        return super()._fused_target(name)


def _our_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF's tensor names under this model's: `model.visual.X` -> `visual.X`, `model.language_model.X` ->
    `model.X` (transformers 4 checkpoints: `visual.X` and `model.X` already)."""
    for name, tensor in weights:
        if name.startswith("model.visual."):
            name = name[len("model."):]
        elif name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        yield name, tensor


def max_image_patches(model_path: str, max_pixels: int | None = None) -> int | None:
    """The most patches the image processor makes of one image: its max pixels (max_pixels, else the model
    folder's preprocessor_config.json's) over a patch's; None when neither says."""
    try:
        pre = json.loads((Path(model_path) / "preprocessor_config.json").read_text())
    except (OSError, ValueError):
        pre = {}
    max_pixels = max_pixels or pre.get("max_pixels") or (pre.get("size") or {}).get("longest_edge")
    patch = int(pre.get("patch_size", 14))
    return int(max_pixels) // (patch * patch) if max_pixels else None


def encoder_groups(grids: Sequence[tuple[int, int, int]], budget: int | None) -> list[list[int]]:
    """The images (indices, in order) of each vision-tower call: consecutive images of at most `budget` patches
    together (an image larger than that alone); None: all in one call."""
    if budget is None:
        return [list(range(len(grids)))]
    groups, size = [], budget + 1
    for i, (t, h, w) in enumerate(grids):
        n = t * h * w
        if size + n > budget:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def mrope_positions(input_ids: Sequence[int], images: Sequence[tuple[int, tuple[int, int, int]]],
                    merge: int) -> tuple[torch.Tensor, int]:
    """A prompt's M-RoPE positions [3, len] and its mrope_position_delta (HF's get_rope_index for images):
    images: (offset of its first pad token, grid_thw) in order. Text continues after an image at its start +
    max(h, w) / merge."""
    cols, pos, at = [], 0, 0
    for offset, (t, h, w) in images:
        if offset > at:
            cols.append(torch.arange(pos, pos + offset - at).expand(3, -1))
            pos += offset - at
        gh, gw = h // merge, w // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        cols.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        at = offset + t * gh * gw
        pos += max(gh, gw)
    if len(input_ids) > at:
        cols.append(torch.arange(pos, pos + len(input_ids) - at).expand(3, -1))
    positions = torch.cat(cols, dim=1) if cols else torch.zeros(3, 0, dtype=torch.int64)
    delta = int(positions.max()) + 1 - len(input_ids) if positions.numel() else 0
    return positions, delta
