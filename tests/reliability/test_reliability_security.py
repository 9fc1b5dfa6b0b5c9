"""Security of a live server (real engine, default model, --api-key), read from /proc:

* the ZMQ sockets are Unix sockets in one private folder (0700, owned by the server's user), removed when
  the server exits;
* no TCP or UDP socket of the process tree other than the HTTP port, even under load (checked again with
  psutil);
* --api-key guards every route of the app (each one in its OpenAPI spec, the spec and docs themselves,
  unknown paths) except /health and /metrics; a missing, wrong or non-Bearer key is a 401 with the OpenAI
  error body, answered before the body is read; the key is not echoed by any endpoint or the log;
* DUET_API_KEY sets the key without putting it on the command line (where `ps` shows it to every user).
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import httpx
import pytest

from tests.fake_scheduler import ServerProcess, pid_alive
from tests.reliability_utils import process_tree, tree_sockets, wait_until

KEY = "sk-reliability-" + "7f3a9c"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPEN = {"/health", "/metrics"}


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess("--api-key", KEY, model_dir=model_dir, fake=False).wait_healthy(300)
    yield srv
    tree = process_tree(srv.proc.pid)
    _, _, unix = tree_sockets(srv.proc.pid)
    assert srv.stop() == 0, srv.output()[-3000:]
    wait_until(lambda: not any(pid_alive(p) for p in tree), 10, f"the process tree {tree} to exit")
    for path in unix.values():  # the socket folder went with the server
        assert not Path(path).parent.exists(), f"{Path(path).parent} was left behind"
    assert KEY not in srv.output(), "the API key was written to the log"


def error_401(resp: httpx.Response) -> bool:
    """A 401 in the route's error shape: OpenAI's, or Anthropic's on the /v1/messages routes."""
    if resp.status_code != 401 or resp.headers.get("www-authenticate") != "Bearer":
        return False
    body = resp.json()
    err = body.get("error", {})
    if resp.request.url.path.startswith("/v1/messages"):
        return body.get("type") == "error" and err.get("type") == "authentication_error"
    return set(err) == {"message", "type", "param", "code"} and err["code"] == 401 \
        and err["type"] == "AuthenticationError"


# ---- IPC sockets --------------------------------------------------------------------------------------


def test_zmq_sockets_live_in_a_private_folder(server):
    per_pid, _, unix = tree_sockets(server.proc.pid)
    assert len(per_pid) >= 3, per_pid
    paths = sorted(set(unix.values()))
    # http_in (HTTP process), scheduler_in (scheduler), detokenizer_in (detokenizer): bound Unix sockets.
    assert {Path(p).name for p in paths} == {"http_in", "scheduler_in", "detokenizer_in"}, paths
    folders = {Path(p).parent for p in paths}
    assert len(folders) == 1, folders
    folder = folders.pop()
    st = os.stat(folder)
    assert folder.name.startswith("duet-ipc-"), folder
    assert stat.S_IMODE(st.st_mode) == 0o700, oct(st.st_mode)
    assert st.st_uid == os.getuid() == Path(f"/proc/{server.proc.pid}").stat().st_uid
    for p in paths:
        assert os.stat(p).st_uid == os.getuid()
    # Nobody else can even look inside: the folder has no group or other permission bits.
    assert st.st_mode & 0o077 == 0


# ---- network -------------------------------------------------------------------------------------------


def _stream_in_background(url: str, n: int) -> list[threading.Thread]:
    def run(i):
        body = {"prompt": f"load {i}", "max_tokens": 48, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_only_the_http_port_is_open(server):
    threads = _stream_in_background(server.url, 8)
    try:
        wait_until(lambda: httpx.get(f"{server.url}/server_info", headers=AUTH, timeout=10).json()
                   ["num_inflight_requests"] >= 8, 60, "the streams to run")
        per_pid, inet, _ = tree_sockets(server.proc.pid)
    finally:
        for t in threads:
            t.join(120)
    assert inet, "no socket found at all: the /proc parsing is broken"
    assert all(s.proto in ("tcp", "tcp6") for s in inet), [s for s in inet if not s.proto.startswith("tcp")]
    assert all(s.local[1] == server.port for s in inet), [s for s in inet if s.local[1] != server.port]
    listening = [s for s in inet if s.state == "0A"]
    assert [(s.local, s.proto) for s in listening] == [(("127.0.0.1", server.port), "tcp")], listening
    assert sum(s.state == "01" for s in inet) >= 8  # the streams' connections: same port
    # Only the HTTP process holds inet sockets; the scheduler and the detokenizer hold none.
    inet_inodes = {s.inode for s in inet}
    holders = {pid for pid, inodes in per_pid.items() if inodes & inet_inodes}
    assert holders == {server.proc.pid}, holders


def test_only_the_http_port_is_open_psutil(server):
    import psutil  # a dev dependency: a broken install must fail, not skip

    seen = 0
    for pid in process_tree(server.proc.pid):
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            assert pid == server.proc.pid and conn.laddr.port == server.port, (pid, conn)
            seen += 1
    assert seen >= 1, "psutil saw no socket at all, not even the listening one"


# ---- API key -----------------------------------------------------------------------------------------------


def _routes(url: str) -> list[tuple[str, str]]:
    spec = httpx.get(f"{url}/openapi.json", headers=AUTH, timeout=10).json()
    routes = [(m.upper(), p.replace("{model_id}", "anything")) for p, item in spec["paths"].items() for m in item]
    assert len(routes) >= 10, routes
    return routes + [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/no/such/route"),
                     ("DELETE", "/v1/models"), ("PUT", "/generate")]


def test_api_key_guards_every_route(server):
    bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                   {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                   {"Authorization": f"Bearer {KEY[:-1]}"}, {"X-API-Key": f"{KEY}x"}, {"X-API-Key": "Bearer " + KEY},
                   {"Authorization": "Bearer"}]
    checked = 0
    for method, path in _routes(server.url):
        if path in OPEN:
            assert httpx.request(method, server.url + path, timeout=10).status_code == 200, path
            continue
        for headers in bad_headers:
            resp = httpx.request(method, server.url + path, headers=headers, json={}, timeout=10)
            assert error_401(resp), (method, path, headers, resp.status_code, resp.text[:200])
            checked += 1
        resp = httpx.request(method, f"{server.url}{path}?api_key={KEY}", json={}, timeout=10)
        assert error_401(resp), (method, path, "query parameter")
        # With the key the route answers (whatever the answer to an empty body is), never 401.
        resp = httpx.request(method, server.url + path, headers=AUTH, json={}, timeout=30)
        assert resp.status_code != 401 and resp.status_code < 500, (method, path, resp.status_code, resp.text)
        lower = {"Authorization": f"bearer {KEY}"}  # the scheme is case-insensitive (RFC 7235)
        assert httpx.request(method, server.url + path, headers=lower, json={}, timeout=30).status_code != 401
        anthropic = {"x-api-key": KEY}  # how Anthropic clients send the key
        assert httpx.request(method, server.url + path, headers=anthropic, json={}, timeout=30).status_code != 401
    print(f"\nAPI key: {checked} unauthenticated requests, all 401")


def test_unauthenticated_body_is_not_read(server):
    """A client without the key cannot make the server buffer a body: the 401 comes before the upload."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 50000000\r\n\r\n")
        # Not one body byte is sent: a server that waited for the body would never answer (socket timeout).
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 401"), head[:200]


def test_the_key_is_not_echoed(server):
    info = httpx.get(f"{server.url}/server_info", headers=AUTH, timeout=10)
    assert info.json()["args"]["api_key"] == "<redacted>"
    for path in ("/server_info", "/get_server_info", "/metrics", "/openapi.json", "/v1/models"):
        assert KEY not in httpx.get(server.url + path, headers=AUTH, timeout=10).text, path
    resp = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": "Bearer nope"}, json={}, timeout=10)
    assert "nope" not in resp.text and KEY not in resp.text


def test_api_key_from_the_environment(tmp_path):
    """DUET_API_KEY: the key is enforced and absent from the command line (visible to every user in ps)."""
    key = "sk-env-" + "41b2"
    srv = ServerProcess(env={"DUET_API_KEY": key}).wait_healthy(120)  # the fake scheduler: fast
    try:
        cmdline = Path(f"/proc/{srv.proc.pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline
        assert error_401(httpx.get(f"{srv.url}/v1/models", timeout=10))
        ok = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert ok.status_code == 200
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    finally:
        assert srv.stop() == 0
