"""CPU threads: the scheduler process's intra-op pool covers the cores this process may run on.

torch sizes its pool from the machine's cores, which is wrong under `taskset`, cgroups' cpusets or a
container limited to some cores: more threads than usable cores makes every parallel op wait on threads
that are not running. The HTTP and detokenizer processes never import torch (server/detokenizer.py's
load_tokenizer avoids it), so they own no pool to compete with this one.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("duet.cpu_threads")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def configure_scheduler_threads(device: str) -> int | None:
    """On CPU, set torch's intra-op threads to the usable cores (OMP_NUM_THREADS, when set, wins); returns
    the count, or None on GPU (host threads there only launch kernels)."""
    if device != "cpu":
        return None
    import torch

    explicit = os.environ.get("OMP_NUM_THREADS")
    threads = int(explicit) if explicit and explicit.isdigit() and int(explicit) > 0 else usable_cores()
    torch.set_num_threads(threads)
    logger.info("intra-op threads: %d (%s)", threads, "OMP_NUM_THREADS" if explicit else "usable cores")
    return threads
