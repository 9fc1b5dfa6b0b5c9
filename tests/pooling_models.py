"""Tiny pooling model folders for the embedding and reranking tests: the tiny byte-level tokenizer (with "yes"
and "no" as whole tokens, as a Qwen3-Reranker's vocabulary has them), random Qwen3 weights saved by HF
transformers, and the sentence-transformers files an embedding model ships."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.fake_scheduler import build_tiny_model_folder

TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 336, "hidden_size": 64,
                  "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                  "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def tiny_tokenizer_folder(path: Path) -> Path:
    from transformers import AutoTokenizer

    build_tiny_model_folder(path)
    (path / "config.json").unlink()
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["yes", "no"])  # ids 320 and 321
    tok.save_pretrained(path)
    return path


def _widen(model) -> None:
    with torch.no_grad():  # HF's default init is tiny: widen it so outputs differ meaningfully
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.1)


def save_tiny(path: Path, kind: str = "causal", seed: int = 0, **overrides):
    """A tiny Qwen3 saved by transformers: kind causal (Qwen3ForCausalLM), backbone (Qwen3Model, as
    sentence-transformers saves one: no `model.` prefix, no LM head) or classifier
    (Qwen3ForSequenceClassification, one label). Returns the HF model (float32, eval)."""
    import transformers

    tiny_tokenizer_folder(path)
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**{k: v for k, v in {**TINY_QWEN3, **overrides}.items()
                                      if k not in ("architectures", "model_type")})
    if kind == "classifier":
        cfg.num_labels = 1
        cfg.pad_token_id = 2
        model = transformers.Qwen3ForSequenceClassification(cfg)
    elif kind == "backbone":
        model = transformers.Qwen3Model(cfg)
    else:
        model = transformers.Qwen3ForCausalLM(cfg)
    _widen(model)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


def write_sentence_transformers_files(path: Path, pooling: str = "lasttoken", normalize: bool = True) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))


def fuzz_routes(url: str, paths: list[str], examples: int = 25) -> dict:
    """Schemathesis against the server's own OpenAPI spec, valid and invalid bodies for each POST path: no
    5xx, a 4xx carries the OpenAI error body with `code` equal to its status, the status is documented, and
    the server stays healthy. Returns the statuses seen per path."""
    import httpx
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import status_code_conformance

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    seen: dict[str, dict[int, int]] = {}
    for path in paths:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            operation = schema[path]["POST"]

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case):
                resp = case.call(base_url=url, timeout=60)
                counts = seen.setdefault(path, {})  # noqa: B023 (called within this iteration)
                counts[resp.status_code] = counts.get(resp.status_code, 0) + 1
                assert resp.status_code < 500, (resp.status_code, resp.text[:300], case.body)
                if resp.status_code >= 400:
                    error = resp.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"}, resp.text
                    assert error["code"] == resp.status_code
                case.validate_response(resp, checks=[not_a_server_error, status_code_conformance])

            fuzz()
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    return seen
