"""The model's generation_config.json sampling values apply where a request leaves a value unset
(--sampling-defaults model, the default); --sampling-defaults openai keeps the OpenAI API's values."""

from __future__ import annotations

import json

import httpx
import pytest

from server.protocol_convert import build_params as _build_params
from tests.fake_scheduler import ServerProcess, build_tiny_model_folder

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
OPENAI = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}


def _params(defaults, **request):
    fields = {"temperature": None, "top_p": None, "top_k": None, "min_p": None, **request}
    return _build_params(defaults=defaults, max_tokens=4, seed=None, stop=None, stop_token_ids=None,
                         ignore_eos=False, min_tokens=0, top_logprobs=None, **fields)


def test_unset_values_take_the_defaults_and_set_ones_win():
    defaults = {**OPENAI, **MODEL_DEFAULTS}
    p = _params(defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.6, 0.95, 20, 0.0)
    p = _params(defaults, temperature=0.0, top_k=-1, top_p=1.0, min_p=0.1)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 1.0, -1, 0.1)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = build_tiny_model_folder(tmp_path_factory.mktemp("gen_defaults") / "m", with_weights=True)
    (folder / "generation_config.json").write_text(json.dumps({**MODEL_DEFAULTS, "repetition_penalty": 1.1}))
    return folder


@pytest.mark.parametrize("mode,expected", [("model", {**OPENAI, **MODEL_DEFAULTS}), ("openai", OPENAI)])
def test_server_applies_the_mode(model_folder, mode, expected):
    server = ServerProcess("--sampling-defaults", mode, model_dir=model_folder, fake=True).wait_healthy()
    try:
        info = httpx.get(f"{server.url}/server_info", timeout=10).json()
        assert info["sampling_defaults"] == expected
        r = httpx.post(f"{server.url}/generate", json={"text": "the cat", "sampling_params": {"max_new_tokens": 2}},
                       timeout=30)
        assert r.status_code == 200, r.text
    finally:
        assert server.stop() == 0
