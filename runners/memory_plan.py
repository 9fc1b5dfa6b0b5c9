"""How device memory is split between the weights, the KV cache, CUDA graphs and activations.

Pure arithmetic on measured numbers, so it is tested on CPU; the model runner does the measuring.
Accounting as vLLM does it: `--mem-fraction-static` of the GPU is the budget for everything this process
holds. What is in use once the weights are loaded (weights, request table, attention workspaces, the CUDA
context, other processes) is measured with the allocator cache emptied; the activation peak is measured
by a profile forward at the largest eager extend; the graph-capture reserve is computed (see
`estimate_graph_reserve`), and checked against the capture's measured size afterwards. The KV cache gets
what is left of the budget.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GiB = 1024**3

# Graph-capture reserve: each graph pool gets a floor that covers the capture sizes measured on the H200
# (docs/benchmarks.md), or a multiple of the activation bytes its largest size needs when that is larger
# (pieces keep their outputs alive in the pool, hence more than one forward). The model runner logs what
# capture really took beside it.
DECODE_POOL_FLOOR = GiB // 2
EXTEND_POOL_FLOOR = GiB // 2
POOL_ACTIVATION_FACTOR = 2
LOGITS_BYTES = 4  # the decode graphs' static float32 logits buffer lives outside the pool


class MemoryBudgetError(RuntimeError):
    """The KV cache does not fit; the message is one line naming the flag to change."""


def estimate_graph_reserve(*, activation_bytes_per_token: float, decode_max_bs: int, vocab_size: int,
                           extend_max_tokens: int, backend_bytes: int = 0, verify_max_tokens: int = 0) -> int:
    """Bytes to keep free for CUDA-graph capture: 0 when nothing is captured.

    backend_bytes: what the attention backend allocates for graphs (e.g. flashinfer's index buffer).
    verify_max_tokens: the largest speculative verify graph's tokens (it shares the decode graphs' pool)."""
    reserve = 0
    if decode_max_bs > 0:
        pool = max(DECODE_POOL_FLOOR,
                   POOL_ACTIVATION_FACTOR * max(decode_max_bs, verify_max_tokens) * activation_bytes_per_token)
        reserve += int(pool) + decode_max_bs * vocab_size * LOGITS_BYTES + backend_bytes
    if extend_max_tokens > 0:
        reserve += int(max(EXTEND_POOL_FLOOR, POOL_ACTIVATION_FACTOR * extend_max_tokens * activation_bytes_per_token))
    return reserve


@dataclass(frozen=True)
class MemorySplit:
    """Bytes. On CPU only weights and kv are filled in (the KV size there is a token budget)."""

    device: str
    weights: int
    kv: int
    num_slots: int
    total: int = 0  # device memory
    budget: int = 0  # total x --mem-fraction-static
    other: int = 0  # in use before the KV cache besides the weights: CUDA context, pools, other processes
    activations: int = 0  # reserve: the profiled peak of the largest eager extend (measured)
    graphs: int = 0  # reserve for graph capture (computed)
    graphs_measured: int | None = None  # what capture really took, once it ran
    lora: int = 0  # the LoRA adapters' device pool (model_executor/lora/manager.py), allocated before the KV

    def as_dict(self) -> dict:
        """For /server_info: sizes in GiB (`*_gib`), the slot count as is."""
        out = {"device": self.device, "num_slots": self.num_slots}
        for name, value in asdict(self).items():
            if name not in out and value is not None:
                out[f"{name}_gib"] = round(value / GiB, 3)
        return out

    def line(self) -> str:
        def g(b: int) -> str:
            return f"{b / GiB:.2f}"

        lora = f", LoRA pool {g(self.lora)} GiB" if self.lora else ""
        if self.total == 0:
            return (f"memory ({self.device}): weights {g(self.weights)} GiB{lora}, KV {g(self.kv)} GiB "
                    f"({self.num_slots} slots, a token budget), no graph or activation reserve")
        measured = "" if self.graphs_measured is None else f" (capture took {g(self.graphs_measured)})"
        return (f"memory ({self.device}, {g(self.total)} GiB, budget {g(self.budget)} GiB): weights "
                f"{g(self.weights)} GiB{lora}, KV {g(self.kv)} GiB ({self.num_slots} slots), graphs reserve "
                f"{g(self.graphs)} GiB{measured}, activations reserve {g(self.activations)} GiB, other "
                f"{g(self.other)} GiB")


def plan_kv_cache(*, total: int, free: int, weights: int, activations: int, graphs: int, fraction: float,
                  bytes_per_slot: int, max_total_tokens: int | None = None, device: str = "cuda") -> MemorySplit:
    """Split the budget: KV = total x fraction - in use now - activation reserve - graph reserve.

    total, free: the device's memory after the weights are loaded and the allocator cache is emptied."""
    used = total - free
    budget = int(total * fraction)
    kv_budget = budget - used - activations - graphs
    slots = max(kv_budget, 0) // bytes_per_slot
    if max_total_tokens:
        slots = min(slots, max_total_tokens)
    if slots < 1:
        raise MemoryBudgetError(
            f"not enough GPU memory for the KV cache: --mem-fraction-static {fraction} of {total / GiB:.1f} GiB "
            f"is {budget / GiB:.1f} GiB, of which {used / GiB:.1f} GiB is in use after loading the weights "
            f"({weights / GiB:.1f} GiB) and {(activations + graphs) / GiB:.1f} GiB is reserved for activations "
            f"and graphs; raise --mem-fraction-static (or lower --max-prefill-tokens / --cuda-graph-max-bs)")
    return MemorySplit(device=device, weights=weights, kv=slots * bytes_per_slot, num_slots=slots, total=total,
                       budget=budget, other=max(used - weights, 0), activations=activations, graphs=graphs)
