"""Waiting-queue order: FCFS, or longest prefix match first (LPM) when the radix cache is on."""

from __future__ import annotations

from scheduler.radix_cache import RadixCache
from scheduler.req import Req

# Matching every waiting request costs a tree walk each; past this queue length LPM falls back to FCFS.
LPM_MAX_QUEUE = 128


def order_waiting(waiting: list[Req], policy: str, tree: RadixCache | None) -> list[Req]:
    if policy == "fcfs" or tree is None or len(waiting) > LPM_MAX_QUEUE:
        return waiting
    # Retracted requests keep their place at the front; the rest by matched prefix length, stable.
    def matched(req: Req) -> int:
        return len(tree.match_prefix(req.cache_key[:-1], req.lora_id)[0])

    return sorted(waiting, key=lambda r: (r.num_retractions == 0, -matched(r)))
