"""The request fields a client sets as one number or name, each declared once.

One row per field: its name (the same in the neutral Request, OpenAI's JSON bodies and the
ssd.v1 proto), its type, what a valid value is, what it is when neither the request nor the
server gives one (OpenAI's default), and, for the fields a server may default, the CLI flag
that sets both the command's own value and the server's (`serve_defaults`). Everything that
handles these fields is made from this table: the checks of the config (ssd.config) and of
each request (ssd.serve.validation), the OpenAI bodies (ssd.openai.schema), the gRPC
conversion (ssd.serve.convert), the CLI flags (ssd.app.cli), the client and the model card;
tests/test_fields.py holds each of them to it.

A new sampling parameter is a row here, a field of SamplingConfig and of the neutral
Request, the sampler's use of it (ssd.sampling) and its proto field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

MAX_INT32 = 2**31 - 1
MAX_SEED = 2**64 - 1
MAX_PENALTY = 2.0  # OpenAI: presence and frequency penalties in -2..2
COUPLINGS = ("standard", "gumbel")  # docs/exactness.md


class FieldError(ValueError):
    """A request field is invalid; str() starts with the field's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class RequestField:
    name: str
    kind: type  # int, float or str
    rule: str  # what a valid value is, as an error says it
    valid: Callable[[Any], bool]
    unset: Any  # the value when neither the request nor the server gives one; None: none (seed: drawn)
    help: str  # the CLI flag's help; "" where the field has no flag
    section: str = ""  # the config section the flag overrides ("sampling"); "": no flag
    server_default: bool = False  # serve_defaults may hold the server's own default (the flag sets it too)
    choices: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> Any:
        """`value`, or FieldError naming the field where it breaks the rule (None passes: unset)."""
        if value is not None and not self.valid(value):
            raise FieldError(self.name, f"must be {self.rule}, got {value!r}")
        return value

    def resolve(self, given: Any, server: Any = None) -> Any:
        """The request's value, else the server's default, else `unset`; checked."""
        return self.check(given if given is not None else server if server is not None else self.unset)


def _finite(low: float, high: float) -> Callable[[Any], bool]:
    return lambda v: math.isfinite(v) and low <= v <= high  # NaN fails every comparison too


FIELDS: tuple[RequestField, ...] = (
    RequestField("max_new_tokens", int, "an integer >= 1", lambda v: v >= 1, None,
                 "override generation.max_new_tokens; a server's default too (unset: up to the context)",
                 "generation", server_default=True),
    RequestField("temperature", float, "a finite number >= 0 (0: greedy)", _finite(0, math.inf), 1.0,
                 "override sampling.temperature (0: greedy); a server's default too", "sampling", True),
    RequestField("top_k", int, f"in 0..{MAX_INT32} (0: off)", lambda v: 0 <= v <= MAX_INT32, 0,
                 "override sampling.top_k (0: off); a server's default too", "sampling", True),
    RequestField("top_p", float, "in (0, 1]", lambda v: 0 < v <= 1, 1.0,
                 "override sampling.top_p; a server's default too", "sampling", True),
    RequestField("min_p", float, "in [0, 1] (0: off)", lambda v: 0 <= v <= 1, 0.0,
                 "override sampling.min_p (0: off); a server's default too", "sampling", True),
    RequestField("seed", int, "in 0..2**64-1", lambda v: 0 <= v <= MAX_SEED, None,
                 "override sampling.seed; a server's default too (unset: a fresh seed per request)",
                 "sampling", True),
    RequestField("coupling", str, f"one of {', '.join(COUPLINGS)}", lambda v: v in COUPLINGS, None,
                 "override sampling.coupling (gumbel: a seed gives AR's output in every mode; unset: "
                 "gumbel for a seeded request)", "sampling", True, COUPLINGS),
    RequestField("presence_penalty", float, "in -2..2", _finite(-MAX_PENALTY, MAX_PENALTY), 0.0, ""),
    RequestField("frequency_penalty", float, "in -2..2", _finite(-MAX_PENALTY, MAX_PENALTY), 0.0, ""),
    RequestField("repetition_penalty", float, "a finite number > 0 (1: off)",
                 lambda v: math.isfinite(v) and v > 0, 1.0, ""),
)
BY_NAME: dict[str, RequestField] = {f.name: f for f in FIELDS}
SAMPLING = tuple(f for f in FIELDS if f.section == "sampling")  # SamplingConfig's, in its order
SERVER_DEFAULTS = tuple(f for f in FIELDS if f.server_default)  # RequestDefaults'
FLAGS = tuple(f for f in FIELDS if f.section)  # the CLI's
PENALTIES = tuple(BY_NAME[name] for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"))
