"""Data-parallel routing: which replica serves a request.

least_load: the replica with the fewest requests in flight from this server; ties go round-robin from
the last choice, so sequential requests alternate too.

prefix: the prompt is cut into blocks of PREFIX_BLOCK tokens, each identified by the hash of everything up
to its end (a hash chain, as a radix cache matches prefixes). The router remembers which replica last
served each chain; a prompt whose longest remembered prefix covers at least half of it goes to that
replica (its radix cache holds that prefix: the next turn of a conversation), any other prompt to the
least loaded one. A shared system prompt alone therefore does not pin all traffic to one replica.
"""

from __future__ import annotations

from collections import OrderedDict

PREFIX_BLOCK = 16
MAX_REMEMBERED_BLOCKS = 1 << 18  # least recently used chains are forgotten past this


class DpRouter:
    def __init__(self, size: int, policy: str = "least_load", metrics=None):
        if policy not in ("least_load", "prefix"):
            raise ValueError(f"unknown data-parallel routing {policy!r}")
        self.size = size
        self.policy = policy
        self.metrics = metrics
        self.inflight = [0] * size
        self.routed = [0] * size
        self._last = size - 1
        self._chains: OrderedDict[int, int] = OrderedDict()

    def _least_loaded(self) -> int:
        order = [(self._last + 1 + i) % self.size for i in range(self.size)]
        return min(order, key=lambda r: self.inflight[r])

    @staticmethod
    def _block_hashes(ids: list[int]) -> list[int]:
        hashes, h = [], 0
        for end in range(PREFIX_BLOCK, len(ids) + 1, PREFIX_BLOCK):
            h = hash((h, tuple(ids[end - PREFIX_BLOCK : end])))
            hashes.append(h)
        return hashes

    def choose(self, input_ids: list[int]) -> int:
        """The replica for a request with this prompt; counts it in flight until release()."""
        replica = None
        hashes = self._block_hashes(input_ids) if self.policy == "prefix" else []
        for depth in range(len(hashes), 0, -1):
            hit = self._chains.get(hashes[depth - 1])
            if hit is not None:
                if 2 * depth * PREFIX_BLOCK >= len(input_ids):
                    replica = hit
                break
        if replica is None:
            replica = self._least_loaded()
        for h in hashes:
            self._chains[h] = replica
            self._chains.move_to_end(h)
        while len(self._chains) > MAX_REMEMBERED_BLOCKS:
            self._chains.popitem(last=False)
        self._last = replica
        self.inflight[replica] += 1
        self.routed[replica] += 1
        if self.metrics is not None:
            self.metrics.dp_routed.labels(replica=str(replica)).inc()
        return replica

    def release(self, replica: int) -> None:
        self.inflight[replica] -= 1


def merge_stats(replies: list[dict]) -> dict:
    """One stats snapshot over all replicas: counts summed (nested dicts per key), rates averaged, other
    values replica 0's; each replica's own under "replicas"."""

    def merge(values: list):
        first = values[0]
        if isinstance(first, bool) or not all(isinstance(v, type(first)) for v in values):
            return first
        if isinstance(first, (int, float)):
            return sum(values)
        if isinstance(first, dict):
            keys = {k for v in values for k in v}
            return {k: merge([v[k] for v in values if k in v]) for k in keys}
        return first

    out = {}
    for key in replies[0]:
        values = [r[key] for r in replies if key in r]
        out[key] = sum(values) / len(values) if key.endswith("_rate") else merge(values)
    out["replicas"] = replies
    return out
