"""LoraManager: the adapters a server has loaded, the device pool of slots they run from, and the LoRA layers.

Two tiers, as SGLang's: `load` reads an adapter into host memory (at most max_loaded adapters; each gets a uid
that is never reused, so the prefix cache of a reloaded name starts empty); `prepare` puts a batch's adapters
into the device pool's slots (max_per_batch of them, allocated once at start-up, padded to max_rank) and
returns each one's slot. Under tensor parallelism every rank holds the whole adapter on the host and its own
shards in its pool, cut as the layer's weight is (LinearBase.lora_shard): column-parallel qkv and gate_up take
their rows of B (A whole), row-parallel o and down their columns of A (B whole) and add the update to the partial
output before the layer's all-reduce, so LoRA adds no communication. A slot goes to the least recently used adapter that the batch does not need and that is
not pinned. Slot 0 is "no adapter" (zeros). Copying an adapter into a slot writes into the pool's tensors in
place, so a captured decode graph (which reads the pool and the slot ids at fixed addresses) never recaptures.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from model_executor.lora.adapter import FUSED, TARGET_MODULES, LoraAdapter, LoraError, read_adapter
from model_executor.lora.layer import LoraLayer

logger = logging.getLogger("duet.lora")


@dataclass(frozen=True)
class LoraConfig:
    """The server's LoRA flags, resolved (server/args.py)."""

    paths: tuple[tuple[str, str], ...] = ()  # (name, folder) loaded at start-up
    max_per_batch: int = 8  # device slots (besides slot 0)
    max_loaded: int | None = None  # adapters in host memory; None: no limit
    max_rank: int = 0  # 0: the largest of `paths`
    target_modules: tuple[str, ...] = ()  # empty: the union of `paths`'
    backend: str = "auto"  # torch / triton; auto: triton on a GPU


def _fused_layers(model: nn.Module) -> list[dict[str, nn.Module]]:
    """Per decoder layer: the fused linear layers an adapter can target, by name."""
    out = []
    for layer in model.model.layers:
        found = {}
        for parent, names in ((getattr(layer, "self_attn", None), ("qkv_proj", "o_proj")),
                              (getattr(layer, "mlp", None), ("gate_up_proj", "down_proj"))):
            for n in names:
                mod = getattr(parent, n, None) if parent is not None else None
                if mod is not None and hasattr(mod, "lora"):
                    found[n] = mod
        out.append(found)
    return out


def _part_slices(layer: nn.Module, fused: str) -> list[tuple[int, int]]:
    """Each part's (offset, size) in a fused layer's output."""
    if fused == "qkv_proj":
        return [(0, layer.q_size), (layer.q_size, layer.kv_size), (layer.q_size + layer.kv_size, layer.kv_size)]
    if fused == "gate_up_proj":
        g = layer.output_sizes[0]
        return [(0, g), (g, layer.output_sizes[1])]
    return [(0, layer.output_size)]


class LoraManager:
    def __init__(self, config: LoraConfig, model: nn.Module, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.device = device
        self.dtype = dtype
        self.backend = config.backend if config.backend != "auto" else ("triton" if device.type == "cuda"
                                                                         else "torch")
        adapters = [read_adapter(name, path) for name, path in config.paths]
        self.max_rank = config.max_rank or max((a.rank for a in adapters), default=0)
        if self.max_rank < 1:
            raise LoraError("--max-lora-rank is needed when no --lora-paths are given")
        targets = set(config.target_modules) or set().union(*(a.targets for a in adapters))
        if not targets:
            raise LoraError("--lora-target-modules is needed when no --lora-paths are given")
        self.target_modules = frozenset(targets)
        self.layers = _fused_layers(model)
        missing = sorted({FUSED[t][0] for t in targets} - set(self.layers[0]))
        if missing:
            raise LoraError(f"--lora-target-modules: this model has no {', '.join(missing)} that LoRA can target")
        n = config.max_per_batch + 1  # slot 0: no adapter
        self.batch = None  # the LoraBatch being run (set by the model runner)
        self.scaling = torch.zeros(n, dtype=torch.float32, device=device)
        self.scaling_host = [0.0] * n
        self.pool_bytes = self.scaling.numel() * 4
        fused_targets = {FUSED[t][0] for t in targets}
        for mods in self.layers:
            for fused, mod in mods.items():
                if fused not in fused_targets:
                    continue
                slices = _part_slices(mod, fused)
                in_size = mod.input_size  # this rank's (row-parallel o and down: a share of the input)
                a = torch.zeros(n, len(slices) * self.max_rank, in_size, dtype=dtype, device=device)
                b = torch.zeros(n, sum(s for _, s in slices), self.max_rank, dtype=dtype, device=device)
                mod.lora = LoraLayer(self, a, b, slices, self.max_rank)
                self.pool_bytes += a.numel() * a.element_size() + b.numel() * b.element_size()
        self._uids = itertools.count()
        self.adapters: dict[str, tuple[int, LoraAdapter]] = {}  # name -> (uid, adapter), host tier
        self.pinned: set[int] = set()
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # uid -> slot, least recently used first
        self._by_uid: dict[int, LoraAdapter] = {}
        for adapter in adapters:
            self._register(adapter, pinned=False)

    # ---- the host tier ---------------------------------------------------------------------------
    def check(self, adapter: LoraAdapter) -> None:
        """LoraError (one line) for an adapter this pool cannot hold: rank, targets, shapes."""
        if adapter.rank > self.max_rank:
            raise LoraError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} exceeds --max-lora-rank "
                            f"{self.max_rank}")
        extra = sorted(adapter.targets - self.target_modules, key=TARGET_MODULES.index)
        if extra:
            raise LoraError(f"LoRA adapter {adapter.name!r}: targets {extra}, not in --lora-target-modules "
                            f"{sorted(self.target_modules, key=TARGET_MODULES.index)}")
        for (layer, module), (a, b) in adapter.weights.items():
            if layer >= len(self.layers):
                raise LoraError(f"LoRA adapter {adapter.name!r}: layer {layer}, but the model has "
                                f"{len(self.layers)} layers")
            fused, part = FUSED[module]
            try:
                self.layers[layer][fused].lora_shard(part, a, b)
            except ValueError as e:
                raise LoraError(f"LoRA adapter {adapter.name!r}: layer {layer} {module} A {tuple(a.shape)} B "
                                f"{tuple(b.shape)} does not fit the model {e}") from None

    def _register(self, adapter: LoraAdapter, pinned: bool) -> int:
        self.check(adapter)
        if adapter.name in self.adapters:
            raise LoraError(f"LoRA adapter {adapter.name!r} is already loaded")
        if self.config.max_loaded is not None and len(self.adapters) >= self.config.max_loaded:
            raise LoraError(f"cannot load LoRA adapter {adapter.name!r}: {len(self.adapters)} adapters are loaded "
                            f"(--max-loaded-loras {self.config.max_loaded}); unload one first")
        if pinned and len(self.pinned) + 1 >= self.config.max_per_batch:
            raise LoraError(f"cannot pin LoRA adapter {adapter.name!r}: at most --max-loras-per-batch - 1 = "
                            f"{self.config.max_per_batch - 1} adapters may be pinned")
        uid = next(self._uids)
        self.adapters[adapter.name] = (uid, adapter)
        self._by_uid[uid] = adapter
        if pinned:
            self.pinned.add(uid)
        logger.info("loaded LoRA adapter %s (rank %d, %s) from %s", adapter.name, adapter.rank,
                    ", ".join(sorted(adapter.targets, key=TARGET_MODULES.index)), adapter.path)
        return uid

    def load(self, name: str, path: str, pinned: bool = False) -> int:
        """Read and register an adapter; its uid. LoraError (one line) when it cannot be served."""
        if name in self.adapters:
            raise LoraError(f"LoRA adapter {name!r} is already loaded")
        return self._register(read_adapter(name, path), pinned)

    def unload(self, name: str) -> None:
        uid, _ = self.adapters.pop(name)
        del self._by_uid[uid]
        self.pinned.discard(uid)
        slot = self._slot_of.pop(uid, None)
        if slot is not None:
            self._clear(slot)

    def uid(self, name: str) -> int | None:
        entry = self.adapters.get(name)
        return None if entry is None else entry[0]

    def names(self) -> list[str]:
        return list(self.adapters)

    # ---- the device pool -------------------------------------------------------------------------
    def fits(self, uids: set[int]) -> bool:
        """Whether a batch of these adapters (None: the base model) has slots, beside the pinned ones."""
        return len((uids - {None}) | self.pinned) <= self.config.max_per_batch

    def prepare(self, uids: list[int | None]) -> list[int]:
        """Each request's slot (0 for the base model), loading the batch's adapters into the pool."""
        needed = {u for u in uids if u is not None}
        assert self.fits(needed), "more adapters in one batch than --max-loras-per-batch"
        for uid in needed | self.pinned:
            if uid in self._slot_of:
                self._slot_of.move_to_end(uid)
            else:
                self._slot_of[uid] = self._free_slot(needed)
                self._copy_in(self._slot_of[uid], self._by_uid[uid])
        return [0 if u is None else self._slot_of[u] for u in uids]

    def _free_slot(self, needed: set[int]) -> int:
        used = set(self._slot_of.values())
        for slot in range(1, self.config.max_per_batch + 1):
            if slot not in used:
                return slot
        victim = next(u for u in self._slot_of if u not in needed and u not in self.pinned)  # LRU first
        return self._slot_of.pop(victim)

    def _copy_in(self, slot: int, adapter: LoraAdapter) -> None:
        self._clear(slot)
        for (layer, module), whole in adapter.weights.items():
            fused, part = FUSED[module]
            mod = self.layers[layer][fused]
            a, b = mod.lora_shard(part, *whole)  # this tensor-parallel rank's shard (tp 1: all of it)
            lora = mod.lora
            off, size = lora.out_slices[part]
            r0 = part * self.max_rank
            lora.a[slot, r0:r0 + adapter.rank].copy_(a)
            lora.b[slot, off:off + size, :adapter.rank].copy_(b)
        self.scaling[slot] = adapter.scaling
        self.scaling_host[slot] = adapter.scaling

    def _clear(self, slot: int) -> None:
        for mods in self.layers:
            for mod in mods.values():
                if mod.lora is not None:
                    mod.lora.a[slot].zero_()
                    mod.lora.b[slot].zero_()
        self.scaling[slot] = 0.0
        self.scaling_host[slot] = 0.0

    def slot_of(self, name: str) -> int | None:
        """The adapter's slot, if it is in the pool now (tests, /server_info)."""
        uid = self.uid(name)
        return None if uid is None else self._slot_of.get(uid)

    def info(self) -> dict:
        return {"max_loras_per_batch": self.config.max_per_batch, "max_lora_rank": self.max_rank,
                "lora_target_modules": sorted(self.target_modules, key=TARGET_MODULES.index),
                "lora_backend": self.backend, "lora_pool_bytes": self.pool_bytes, "adapters": self.names()}
