"""The start-up timeline: each phase's seconds on the way to ready, for the log, the ready line and
`/server_info`'s `startup` object ({phase: seconds, ..., "total": seconds}).

Each phase is measured with time.perf_counter at its boundaries in the process where it runs; on one host
perf_counter reads CLOCK_MONOTONIC, so the launcher can subtract the children's readings from its own.
The phases, in order:

- launcher: the launcher's own start (flags, device and model resolved, port bound, IPC folder);
- spawn: the scheduler process from its start until its code runs (a fresh interpreter);
- imports: the scheduler entry's modules (torch, the model code);
- the scheduler process's own, those that ran: weights, memory_profile (GPU), decode_graphs (GPU),
  piecewise_extend (GPU), compile (inductor: the GPU's extend pieces, the CPU's decode with
  --enable-torch-compile), whole_extend_graphs (GPU), tokenizer, scheduler_setup;
- engine_setup: the rest of the scheduler process's start (configs, device, KV cache, attention backend);
- http_start: the HTTP app, from every child ready until it serves.

The HTTP process's tokenizer and the detokenizer load while the scheduler starts: they are no phase, and
`total` (the launcher's start to serving) counts them only where they keep it waiting. With tensor or data
parallelism the scheduler phases are the first rank's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass
class StartupClock:
    """The launcher's readings (time.perf_counter) and what the scheduler process reported."""

    began: float = field(default_factory=time.perf_counter)
    spawned: float | None = None  # the first child was started
    child_started: dict | None = None  # the scheduler child's {"at", "imported_at"}
    engine: dict | None = None  # the scheduler's ready info "startup": {"phases", "ready_at"}
    children_ready: float | None = None  # every child reported ready

    def timeline(self, serving_at: float) -> dict[str, float]:
        """{phase: seconds} in order, then "total"; a phase with no readings (a test's fake scheduler) is left
        out. Phases are disjoint spans of the way to ready, so they add up to at most the total: in whole
        microseconds, phases rounded down and the total up, that holds for the numbers shown too."""
        phases: dict[str, float] = {}
        if self.spawned is not None:
            phases["launcher"] = self.spawned - self.began
            started = self.child_started
            if started is not None:
                phases["spawn"] = started["at"] - self.spawned
                phases["imports"] = started["imported_at"] - started["at"]
                if self.engine is not None:
                    inner = self.engine["phases"]
                    phases.update(inner)
                    phases["engine_setup"] = self.engine["ready_at"] - started["imported_at"] - sum(inner.values())
        if self.children_ready is not None:
            phases["http_start"] = serving_at - self.children_ready
        out = {name: math.floor(seconds * 1e6) / 1e6 for name, seconds in phases.items()}
        out["total"] = math.ceil((serving_at - self.began) * 1e6) / 1e6
        return out


def largest_phases(startup: dict[str, float], most: int = 3) -> str:
    """"startup=6.1s (weights 2.0s, imports 1.8s, tokenizer 0.6s)": the total and the largest phases (the
    earlier of equal ones first)."""
    phases = sorted(((name, s) for name, s in startup.items() if name != "total"), key=lambda p: -p[1])[:most]
    inner = ", ".join(f"{name} {s:.1f}s" for name, s in phases)
    return f"startup={startup['total']:.1f}s" + (f" ({inner})" if inner else "")


def timeline_line(startup: dict[str, float]) -> str:
    """Every phase in order, for the log."""
    return "start-up timeline: " + ", ".join(f"{name} {s:.2f}s" for name, s in startup.items())
