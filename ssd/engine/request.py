"""The one generation interface: a GenerationRequest in, a GenerationResult out.

Every way to generate implements `Generator`: the engines (AR, SD, SSD; a
request alone is a batch of one), the serving backends, the cluster, and the
bench's peers (HF assisted generation, llama.cpp). Speculation settings
travel with each request, so one engine per mode serves every K, budget,
backup and C; `settings(default)` is the one place a request without its own
falls back to a generator's default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ssd.config import GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.fields import PENALTIES
from ssd.engine.metrics import GenerationStats

# Called with the tokens each round admits, as soon as they are known.
TokenCallback = Callable[[list[int]], None]


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one emitted token, and of the most likely alternatives.

    Taken from the logits the round already scored (verification, or the
    target's own step), under the request's sampling settings: log of the
    distribution the token was verified or sampled against (temperature,
    top-k, top-p applied; -inf outside top-k / top-p). Greedy requests
    (temperature 0) get the plain log-softmax, since their distribution is a
    one-hot that says nothing.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob), most likely first
    rank: int = 0  # 1 + the number of tokens more likely (vLLM's); 0: not known


LogprobCallback = Callable[[list[TokenLogprob]], None]


@dataclass(frozen=True)
class Processing:
    """How a request changes the target's logits before sampling (ssd.engine.processing):
    plain data, so it travels with the request to another process.

    logit_bias: (token id, bias) pairs, OpenAI's; penalties as OpenAI defines
    them; grammar: llguidance's serialized grammar (ssd.engine.grammar), or None;
    repetition_penalty: HF's and vLLM's (> 0; 1: off), over the prompt and the output;
    allowed_token_ids: vLLM's, the only tokens that may be drawn (empty: all);
    bad_words: vLLM's, as token id sequences: a sequence's last token is banned
    where the output so far ends with the rest of it (a one-token word: always).
    """

    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: str | None = None
    repetition_penalty: float = 1.0
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        for spec in PENALTIES:  # the request fields' one rule (ssd.fields): FieldError is a ValueError
            spec.check(getattr(self, spec.name))
        if any(not word for word in self.bad_words):
            raise ValueError("bad_words must be non-empty token id sequences")

    @property
    def active(self) -> bool:
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.grammar
                    or self.repetition_penalty != 1 or self.allowed_token_ids or self.bad_words)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    # None: the generator's own settings. A generator refuses a mode it does not run.
    speculation: SpeculationConfig | None = None
    on_tokens: TokenCallback | None = None
    # Polled before every round; True ends generation with finish reason "aborted".
    cancelled: Callable[[], bool] | None = None
    request_id: str = ""  # for logs; the server assigns one when empty
    # None: no log-probabilities; n >= 0: each emitted token's, with the n most likely alternatives.
    logprobs: int | None = None
    # Called, before on_tokens, with the log-probabilities of the tokens that round admitted.
    on_logprobs: LogprobCallback | None = None
    # None: the model's logits as they are; else logit_bias, penalties, a grammar's mask.
    processing: Processing | None = None
    # None: none; n >= 0: each prompt token's after the first (the model's own log-softmax,
    # unprocessed), with the n most likely alternatives; prefill then computes every position's logits.
    prompt_logprobs: int | None = None
    # A predicted output (OpenAI's Predicted Outputs: e.g. the file a code edit rewrites): prompt
    # lookup (ssd.engine.lookup) also searches it for what follows the text's last tokens. Only
    # proposals change, each verified, so the output's law does not.
    prediction: list[int] | None = None
    # Whether on_tokens reaches a client as the tokens come (a stream). False (OpenAI's
    # stream: false): the client sees only the result, so a run cut short by a lost target
    # may start again from the prompt, however far it got (ssd.cluster.batch).
    streams: bool = True

    def __post_init__(self) -> None:
        self.prompt_ids = list(self.prompt_ids)
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")

    def settings(self, default: SpeculationConfig) -> SpeculationConfig:
        """The speculation settings this request runs with: its own, else the generator's `default`."""
        return self.speculation or default

    def portable(self) -> "GenerationRequest":
        """The request without its callbacks, to send to another process."""
        return dataclasses.replace(self, on_tokens=None, cancelled=None, on_logprobs=None)

    def is_cancelled(self) -> bool:
        return self.cancelled is not None and self.cancelled()

    def emit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        if self.on_logprobs is not None and logprobs:
            self.on_logprobs(logprobs)
        if self.on_tokens is not None and tokens:
            self.on_tokens(tokens)


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "length" | "stop" | "aborted"
    stats: GenerationStats
    # Tokens the first reply carried (1 for our engines; HF's first round may carry more).
    first_tokens: int = 1
    # One per token_ids entry when the request asked for logprobs (else None).
    logprobs: list[TokenLogprob] | None = None
    # One per prompt token after the first when the request asked for prompt_logprobs (else None).
    prompt_logprobs: list[TokenLogprob] | None = None


class GeneratorUnavailable(RuntimeError):
    """The generator lost its model in the middle of this request, after tokens
    were streamed (so it could not retry unseen): the client should retry; the
    server answers UNAVAILABLE."""


class Generator(Protocol):
    def generate(self, request: GenerationRequest) -> GenerationResult: ...

    def close(self) -> None: ...
