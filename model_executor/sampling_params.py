"""Per-request sampling parameters: one frozen dataclass, validated once where the request enters."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values is [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")


class SamplingParamsError(ValueError):
    """A user-supplied sampling parameter is invalid; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output, hashable: the scheduler caches compiled grammars by it.

    kind: json_schema (value: the schema as canonical JSON), json_object (any JSON object; value ""),
    regex or ebnf (value: the pattern or grammar text)."""

    kind: str
    value: str = ""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    # None: no logprobs. N >= 0: logprob of the chosen token plus the top-N alternatives.
    top_logprobs: int | None = None
    # Prompt logprobs: the prompt position from which they are reported (None: none). The token there is
    # reported without a value (nothing before it is scored, as in SGLang); every later prompt token gets
    # its logprob given the tokens before it, its rank, and the top `prompt_top_logprobs` alternatives.
    prompt_logprob_start: int | None = None
    prompt_top_logprobs: int = 0
    # OpenAI's penalties on output tokens (0: off) and the HF/vLLM repetition penalty on prompt and
    # output tokens (1: off); logit_bias: (token id, bias) pairs added to the logits.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None
    # The output's text (the detokenizer and the HTTP process; sampling ignores them): special tokens left
    # out or written; written ones set apart by spaces (as HF's slow tokenizers join them); the stop string
    # or stop token that ended the request kept at the end of the text.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = False
    include_stop_str_in_output: bool = False

    @property
    def decode_options(self) -> tuple[bool, bool, bool] | None:
        """What the detokenizer needs beyond the tokens, None when it is all default (the common case)."""
        if self.skip_special_tokens and not self.include_stop_str_in_output:
            return None
        return (self.skip_special_tokens, self.spaces_between_special_tokens, self.include_stop_str_in_output)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise SamplingParamsError naming the first bad field."""

        def fail(param: str, message: str) -> None:
            raise SamplingParamsError(param, message)

        if self.max_new_tokens < 0:
            fail("max_tokens", f"max_tokens must be >= 0, got {self.max_new_tokens}")
        if not self.temperature >= 0.0:
            fail("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            fail("top_k", f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_new_tokens < 0:
            fail("min_tokens", f"min_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            fail("min_tokens", f"min_tokens ({self.min_new_tokens}) must be <= max_tokens ({self.max_new_tokens})")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            fail("top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.prompt_logprob_start is not None and self.prompt_logprob_start < 0:
            fail("logprob_start_len", f"logprob_start_len must be >= 0, got {self.prompt_logprob_start}")
        if not 0 <= self.prompt_top_logprobs <= MAX_TOP_LOGPROBS:
            fail("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_top_logprobs}")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            fail("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(self.stop)}")
        if any(not s for s in self.stop):
            fail("stop", "stop sequences must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "stop_token_ids must be non-negative")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            fail("seed", "seed must fit in a signed 64-bit integer")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                fail(name, f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            fail("repetition_penalty", f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            fail("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if token < 0:
                fail("logit_bias", f"logit_bias token ids must be non-negative, got {token}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                fail("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            fail("response_format", f"unknown grammar kind {self.grammar.kind!r}")
