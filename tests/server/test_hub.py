"""Hub ids: `--model-path org/name` resolves through huggingface_hub's cache (the layout it writes:
models--org--name/snapshots/<commit>/, refs/main), honouring HF_HOME, HF_HUB_OFFLINE, --revision and
--download-dir, and a server started with a hub id serves that snapshot."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from server.model_source import ModelSourceError, resolve_folder
from tests.fake_scheduler import ServerProcess
from tests.models.test_loading import make_servable_tiny

MAIN = "a" * 40  # commit hashes: huggingface_hub takes a 40-hex revision as a commit, anything else as a ref
OTHER = "b" * 40


def add_to_hub_cache(hub_cache: Path, repo_id: str, folder: Path, commit: str, ref: str | None = "main") -> Path:
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, model_dir):
    """HF_HOME with org/tiny cached at two commits (refs/main -> MAIN)."""
    home = tmp_path_factory.mktemp("hf_home")
    tiny = make_servable_tiny(tmp_path_factory.mktemp("tiny_src"), model_dir)
    add_to_hub_cache(home / "hub", "org/tiny", tiny, MAIN)
    add_to_hub_cache(home / "hub", "org/tiny", tiny, OTHER, ref=None)
    return home


def resolve(name: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    folder, from_hub = resolve_folder(name, flag="--model-path", revision=revision, download_dir=download_dir)
    assert from_hub
    return folder


def test_offline_hub_id_resolves_to_the_cached_snapshot(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert resolve("org/tiny") == hf_home / "hub" / "models--org--tiny" / "snapshots" / MAIN
    assert resolve("org/tiny", revision=OTHER) == hf_home / "hub" / "models--org--tiny" / "snapshots" / OTHER
    with pytest.raises(ModelSourceError, match="org/other .* is not in the local Hugging Face cache"):
        resolve("org/other")


def test_download_dir_is_the_cache(hf_home, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert resolve("org/tiny", download_dir=str(hf_home / "hub")).name == MAIN
    with pytest.raises(ModelSourceError, match="not in the local Hugging Face cache"):
        resolve("org/tiny")


def test_a_folder_wins_over_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert resolve_folder("org/tiny", flag="--model-path", revision=None, download_dir=None) == (
        Path("org/tiny"), False)
    with pytest.raises(ModelSourceError, match="is not a folder"):
        resolve_folder("./nope", flag="--model-path", revision=None, download_dir=None)


def test_server_serves_a_hub_id_offline(hf_home):
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    server = ServerProcess(model_dir=Path("org/tiny"), env=env, fake=False)
    try:
        server.wait_healthy()
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["org/tiny"]
        info = httpx.get(f"{server.url}/server_info", timeout=10).json()
        assert info["args"]["model_path"] == str(hf_home / "hub" / "models--org--tiny" / "snapshots" / MAIN)
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": "org/tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0
