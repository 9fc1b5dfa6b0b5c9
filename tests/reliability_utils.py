"""Helpers for the reliability suite (tests/reliability/): sizes, the process tree, its memory
and sockets (read from /proc, so nothing beyond the standard library is needed), and the server's stats.

Sizes: CI runs small numbers on 2 CPU cores; ``DUET_LONG=1`` runs the issue's full numbers by hand.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

LONG = os.environ.get("DUET_LONG", "") not in ("", "0")


def size(ci, long):
    """The CI value, or the --long one when DUET_LONG=1."""
    return long if LONG else ci


def late_request(url: str):
    """During a shutdown: None while /health still says 200; then the response a new completion gets (a 503
    while draining), or "gone" once nothing listens. For wait_until, which polls until it is not None."""
    try:
        if httpx.get(f"{url}/health", timeout=5).status_code == 200:
            return None
        return httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
    except httpx.ConnectError:
        return "gone"


def wait_until(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)


# ---- the process tree ---------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_tree(root: int) -> list[int]:
    """root and all its live descendants (zombies excluded)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    tree, frontier = [], [root] if root in parents else []
    while frontier:
        pid = frontier.pop()
        tree.append(pid)
        frontier.extend(p for p, pp in parents.items() if pp == pid)
    return tree


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (VmRSS), 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(root: int) -> dict[int, int]:
    return {pid: rss_bytes(pid) for pid in process_tree(root)}


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


# ---- sockets --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InetSocket:
    proto: str  # tcp, tcp6, udp, udp6, raw, raw6
    local: tuple[str, int]
    remote: tuple[str, int]
    state: str  # hex TCP state: 0A = LISTEN, 01 = ESTABLISHED
    inode: int


def _hex_addr(text: str) -> tuple[str, int]:
    addr, port = text.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        host = ".".join(str(b) for b in raw[::-1])
    else:  # IPv6: four little-endian 32-bit words
        words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
        host = ":".join(b"".join(words)[i:i + 2].hex() for i in range(0, 16, 2))
    return host, int(port, 16)


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets among pid's open file descriptors."""
    out = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def inet_sockets(pid: int) -> list[InetSocket]:
    """Every TCP/UDP/raw socket of the network namespace of pid (from /proc/<pid>/net/*)."""
    out = []
    for proto in ("tcp", "tcp6", "udp", "udp6", "raw", "raw6"):
        try:
            lines = Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            out.append(InetSocket(proto, _hex_addr(f[1]), _hex_addr(f[2]), f[3], int(f[9])))
    return out


def unix_socket_paths(pid: int) -> dict[int, str]:
    """inode -> bound path of the named Unix sockets in pid's namespace (ZMQ ipc:// endpoints)."""
    out = {}
    try:
        lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        f = line.split()
        if len(f) >= 8 and f[7].startswith("/"):
            out[int(f[6])] = f[7]
    return out


def tree_sockets(root: int) -> tuple[dict[int, set[int]], list[InetSocket], dict[int, str]]:
    """(pid -> socket inodes, the tree's inet sockets, the tree's named unix sockets: inode -> path)."""
    per_pid = {pid: socket_inodes(pid) for pid in process_tree(root)}
    mine = set().union(*per_pid.values()) if per_pid else set()
    inet = [s for s in inet_sockets(root) if s.inode in mine]
    unix = {i: p for i, p in unix_socket_paths(root).items() if i in mine}
    return per_pid, inet, unix


# ---- the server's own view ------------------------------------------------------------------------


def server_info(url: str, headers: dict | None = None) -> dict:
    return httpx.get(f"{url}/server_info", headers=headers, timeout=10).json()


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """Wait until nothing runs, waits or is in flight and no KV slot is held by a request; the stats."""

    def idle():
        info = server_info(url)
        s = info["stats"]
        if (s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_used"] == 0
                and info["num_inflight_requests"] == 0):
            return info
        return None

    try:
        return wait_until(idle, timeout, "the server to go idle", interval=0.2)
    except AssertionError:
        raise AssertionError(f"the server did not go idle: {server_info(url)}") from None


def metric_values(url: str, name: str) -> dict[str, float]:
    """Samples of one Prometheus metric: label text (e.g. 'finish_reason="length"') -> value."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            key, value = line.rsplit(" ", 1)
            out[key[len(name):].strip("{}")] = float(value)
    return out


MiB = 1024 * 1024
