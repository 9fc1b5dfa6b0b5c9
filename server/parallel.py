"""Where the scheduler ranks live: one process per (data-parallel replica, tensor-parallel rank).

A replica is a TP group of `--tp-size` ranks with its own torch.distributed rendezvous; its rank 0 talks
to the HTTP process and the detokenizer over ZMQ, the other ranks only take part in its collectives.
Across hosts (`--nnodes`), node k launches TP ranks [k * per_node, (k + 1) * per_node) and joins the
group at `--dist-init-addr`; the HTTP server runs on node 0 only.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from server.args import ServerArgs, split_host_port


@dataclass(frozen=True)
class SchedulerRank:
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    device: str  # "cpu", or this rank's own GPU "cuda:N"
    dist_init_method: str | None  # tcp://host:port of the replica's TP group; None at tp 1

    @property
    def name(self) -> str:
        """The process name in logs and errors ("the scheduler (tp rank 1) process died")."""
        if self.dp_size == 1 and self.tp_size == 1:
            return "scheduler"
        if self.dp_rank == 0 and self.tp_rank == 0:
            return "scheduler"  # the one /server_info and the tests know as scheduler_pid
        if self.dp_size == 1:
            return f"scheduler (tp rank {self.tp_rank})"
        return f"scheduler (dp replica {self.dp_rank}, tp rank {self.tp_rank})"

    @property
    def talks_to_clients(self) -> bool:
        """TP rank 0 receives the requests and sends the outputs of its replica."""
        return self.tp_rank == 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def plan_ranks(args: ServerArgs) -> list[SchedulerRank]:
    """The scheduler ranks this node launches (all of them on a single host).

    Ports: --dist-init-addr HOST:PORT gives replica d the port PORT + d; without it each replica's
    group meets on a free local port."""
    per_node = args.tp_size // args.nnodes
    local_tp = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)
    ranks = []
    for dp in range(args.dp_size):
        init = None
        if args.tp_size > 1:
            if args.dist_init_addr:
                host, port = split_host_port(args.dist_init_addr)
                init = f"tcp://{host if ':' not in host else f'[{host}]'}:{port + dp}"
            else:
                init = f"tcp://127.0.0.1:{free_port()}"
        for tp in local_tp:
            if args.device == "cuda":
                device = f"cuda:{dp * per_node + tp - args.node_rank * per_node}"
            else:
                device = "cpu"
            ranks.append(SchedulerRank(dp, args.dp_size, tp, args.tp_size, device, init))
    return ranks


def gpus_needed(args: ServerArgs) -> int:
    """GPUs this node needs: one per local rank."""
    return args.dp_size * (args.tp_size // args.nnodes)
