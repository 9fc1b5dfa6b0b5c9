"""Requests -> engine inputs: SamplingParams (with the defaults filled in), grammar specs checked in the HTTP
process (an invalid schema or regex is a 400 naming it before anything reaches the scheduler), n and
best_of, and the usage arithmetic shared by the serving modules."""

from __future__ import annotations

import dataclasses
import json
import re

from model_executor.generation_defaults import fill_unset
from model_executor.sampling_params import GrammarSpec, SamplingParams, SamplingParamsError
from server.protocol import MAX_N, MAX_SUBREQUESTS, ApiError

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def stop_tuple(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def logit_bias_pairs(bias: dict[str, float] | None, param: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """OpenAI sends {"token id as a string": bias}; token ids are checked against the vocabulary later."""
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param) from None
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def build_params(*, defaults: dict, max_tokens: int, temperature, top_p, top_k, min_p, seed, stop,
                 stop_token_ids, ignore_eos: bool, min_tokens: int, top_logprobs: int | None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                 logit_bias: tuple[tuple[int, float], ...] = (), grammar: GrammarSpec | None = None,
                 prompt_logprob_start: int | None = None, prompt_top_logprobs: int = 0,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = False,
                 include_stop_str_in_output: bool = False,
                 param_names: dict[str, str] | None = None) -> SamplingParams:
    """defaults: what a value the request leaves unset (None) becomes (--sampling-defaults)."""
    s = fill_unset({"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}, defaults)
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=float(s["temperature"]),
        top_p=float(s["top_p"]),
        top_k=int(s["top_k"]),
        min_p=float(s["min_p"]),
        seed=seed,
        stop=stop_tuple(stop),
        stop_token_ids=tuple(stop_token_ids or ()),
        ignore_eos=ignore_eos,
        min_new_tokens=min_tokens,
        top_logprobs=top_logprobs,
        presence_penalty=float(presence_penalty),
        frequency_penalty=float(frequency_penalty),
        repetition_penalty=float(repetition_penalty),
        logit_bias=logit_bias,
        grammar=grammar,
        prompt_logprob_start=prompt_logprob_start,
        prompt_top_logprobs=prompt_top_logprobs,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        include_stop_str_in_output=include_stop_str_in_output,
    )
    try:
        params.validate()
    except SamplingParamsError as e:
        names = param_names or {}
        raise ApiError(400, str(e), names.get(e.param, e.param)) from None
    return params


def check_priority(priority: int | None, param: str = "priority") -> None:
    """vLLM's and SGLang's request priority: this server has no priority scheduling (one waiting queue, in
    arrival order or --schedule-policy lpm), so only the default is accepted."""
    if priority not in (None, 0):
        raise ApiError(400, f"{param}: this server has no priority scheduling (--schedule-policy orders the "
                            f"waiting requests); only 0 is accepted, got {priority}", param)


def choices_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    if n == 1 or params.seed is None:
        return [params] * n
    # seed + i per choice (wrapped into int64) so seeded choices differ yet stay reproducible.
    return [dataclasses.replace(params, seed=((params.seed + i + 2**63) % 2**64) - 2**63) for i in range(n)]


def check_n(n: int, num_prompts: int = 1) -> None:
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", "n")
    if n * num_prompts > MAX_SUBREQUESTS:
        raise ApiError(400, f"n x number of prompts must be at most {MAX_SUBREQUESTS}, got {n * num_prompts}",
                       "n")


# ---- grammars -----------------------------------------------------------------------------------


def json_schema_spec(schema, param: str) -> GrammarSpec:
    """A JSON-schema grammar spec, its schema checked by converting it (xgrammar raises on what it cannot do)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, f"{param} must be a JSON object (a JSON schema)", param)
    spec = GrammarSpec("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))
    check_grammar(spec, param)
    return spec


def check_grammar(spec: GrammarSpec, param: str) -> None:
    """Convert the spec to a grammar without a tokenizer (milliseconds): a 400 naming param if it is invalid.
    The scheduler compiles it again against the vocabulary (cached by spec)."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.value, strict_mode=True, max_whitespace_cnt=16)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.value)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the reason
        raise ApiError(400, f"{param}: invalid {spec.kind.replace('_', ' ')}: {grammar_error_reason(e)}",
                       param) from None


def grammar_error_reason(e: Exception) -> str:
    """The first line of an xgrammar error, without the "[time] source.cc:line: " prefix it carries (the client
    needs only the reason)."""
    lines = str(e).strip().splitlines()
    return _XGR_PREFIX.sub("", lines[0]) if lines else type(e).__name__


def request_grammar(req, grammar_enabled: bool, param_prefix: str = "") -> tuple[GrammarSpec | None, str | None]:
    """The one constraint a request asks for (response_format, regex, ebnf, json_schema), and its field name.

    More than one is a 400; any with --grammar-backend none is a 400 too."""
    found: list[tuple[str, GrammarSpec | None]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", GrammarSpec("json_object")))
        else:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ApiError(400, "response_format of type json_schema needs json_schema.schema",
                               "response_format.json_schema")
            found.append(("response_format", None))
    for name in ("json_schema", "regex", "ebnf"):
        value = getattr(req, name, None)
        if value is not None:
            found.append((param_prefix + name, None))
    if not found:
        return None, None
    if len(found) > 1:
        raise ApiError(400, "give at most one of response_format, json_schema, regex and ebnf: got "
                       + ", ".join(p for p, _ in found), found[1][0])
    param, spec = found[0]
    if not grammar_enabled:
        raise ApiError(400, f"{param}: structured outputs are off on this server (--grammar-backend none)", param)
    if spec is not None:
        return spec, param
    if param == "response_format":
        return json_schema_spec(rf.json_schema.schema_, "response_format.json_schema.schema"), param
    name = param[len(param_prefix):]
    value = getattr(req, name)
    if name == "json_schema":
        return json_schema_spec(value, param), param
    spec = GrammarSpec(name, value)
    check_grammar(spec, param)
    return spec, param
