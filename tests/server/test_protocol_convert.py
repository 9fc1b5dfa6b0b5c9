"""Requests -> grammar specs in the HTTP process (server/protocol_convert.py): one spec per request, the same
spec for the same schema whatever its key order (the compile cache's key), 400s naming the field for an
invalid schema, two constraints at once, or any constraint with --grammar-backend none."""

from __future__ import annotations

import pytest

from server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, GenerateSamplingParams
from server.protocol_convert import logit_bias_pairs, request_grammar

MSG = [{"role": "user", "content": "x"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MSG, **kw)


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def test_specs_and_their_cache_key():
    a, _ = request_grammar(chat(response_format=schema_format({"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "string"}}})), True)
    b, _ = request_grammar(chat(response_format=schema_format({"properties": {
        "y": {"type": "string"}, "x": {"type": "integer"}}, "type": "object"})), True)
    assert a == b and a.kind == "json_schema" and hash(a) == hash(b)
    assert request_grammar(chat(response_format={"type": "json_object"}), True)[0].kind == "json_object"
    assert request_grammar(chat(response_format={"type": "text"}), True) == (None, None)
    spec, param = request_grammar(GenerateSamplingParams(regex="[0-9]+"), True, "sampling_params.")
    assert (spec.kind, spec.value, param) == ("regex", "[0-9]+", "sampling_params.regex")
    assert request_grammar(CompletionRequest(prompt="x", ebnf='root ::= "a"'), True)[0].kind == "ebnf"


@pytest.mark.parametrize("req,enabled,param", [
    (chat(response_format=schema_format({"type": "nonsense"})), True, "response_format.json_schema.schema"),
    (chat(response_format={"type": "json_schema"}), True, "response_format.json_schema"),
    (CompletionRequest(prompt="x", regex="(unclosed"), True, "regex"),
    (CompletionRequest(prompt="x", ebnf="root ::= "), True, "ebnf"),
    (CompletionRequest(prompt="x", regex="a", response_format={"type": "json_object"}), True, "regex"),
    (CompletionRequest(prompt="x", regex="a"), False, "regex"),
    (chat(response_format={"type": "json_object"}), False, "response_format"),
    (GenerateSamplingParams(json_schema="{not json"), True, "sampling_params.json_schema"),
])
def test_bad_or_refused_constraints_are_a_400_naming_the_field(req, enabled, param):
    with pytest.raises(ApiError) as e:
        request_grammar(req, enabled, "sampling_params." if isinstance(req, GenerateSamplingParams) else "")
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_logit_bias_keys():
    assert logit_bias_pairs({"7": 1.5, "3": -100}) == ((3, -100.0), (7, 1.5))
    with pytest.raises(ApiError) as e:
        logit_bias_pairs({"abc": 1})
    assert e.value.param == "logit_bias"
