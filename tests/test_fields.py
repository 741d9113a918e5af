"""Each request field declared once (ssd.fields): every consumer is made from the one table or
held to it here, one check raises the field-named error for config and requests alike, and a
field's name stays in a handful of files.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from ssd import fields
from ssd.app import cli
from ssd.app import client as client_app
from ssd.config import ConfigError, RequestDefaults, SamplingConfig
from ssd.fields import FIELDS, RequestField
from ssd.openai import schema
from ssd.serve import protos
from ssd.serve.convert import from_proto
from ssd.serve.request import Request
from tests.conftest import ROOT

# What a client may not send, one value per field (NaN too for each float).
BAD = {"max_new_tokens": 0, "temperature": -0.5, "top_k": -1, "top_p": 0.0, "min_p": 1.5, "seed": -1,
       "coupling": "philox", "presence_penalty": 2.5, "frequency_penalty": -3.0, "repetition_penalty": 0.0}
# Files under ssd/ (the runtime: the tools read configs, they declare nothing) that may name a
# pure request knob: the table, the engine's record (config), the neutral request and its use.
MAX_FILES = 4
KNOBS = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def missing(table: tuple[RequestField, ...]) -> dict[str, list[str]]:
    """For each consumer, the table's fields it lacks."""
    pb, _ = protos.load()
    proto = set(pb.GenerateRequest.DESCRIPTOR.fields_by_name)
    body = set(schema.RequestFields.model_fields) | {"max_new_tokens"}  # max_tokens: the bodies' own names
    request = {f.name for f in dataclasses.fields(Request)}
    cli_flags = set(_flags(cli.add_config_args))
    client_flags = set(_flags(lambda p: client_app.build_parser()))
    sampling = {f.name for f in dataclasses.fields(SamplingConfig)}
    defaults = {f.name for f in dataclasses.fields(RequestDefaults)}
    found = {
        "proto": [f.name for f in table if f.name not in proto],
        "openai bodies": [f.name for f in table if f.name not in body],
        "neutral Request": [f.name for f in table if f.name not in request],
        "CLI flags": [f.name for f in table if f.section and f.flag not in cli_flags],
        "client flags": [f.name for f in table if f.flag not in client_flags],
        "SamplingConfig": [f.name for f in table if f.section == "sampling" and f.name not in sampling],
        "RequestDefaults": [f.name for f in table if f.server_default and f.name not in defaults],
    }
    return {consumer: names for consumer, names in found.items() if names}


def _flags(add) -> list[str]:
    import argparse

    parser = argparse.ArgumentParser()
    built = add(parser) or parser
    return [option for action in built._actions for option in action.option_strings]


def test_every_consumer_has_every_field():
    assert missing(FIELDS) == {}


def test_a_field_added_to_the_table_alone_is_missed_by_each_consumer():
    """Power: a new row with nothing behind it is named missing everywhere it must go."""
    typical_p = RequestField("typical_p", float, "in (0, 1]", lambda v: 0 < v <= 1, 1.0, "help",
                             "sampling", server_default=True)
    assert set(missing((*FIELDS, typical_p))) == {"proto", "openai bodies", "neutral Request", "CLI flags",
                                                  "client flags", "SamplingConfig", "RequestDefaults"}


@pytest.mark.parametrize("spec", FIELDS, ids=lambda f: f.name)
def test_one_rule_refuses_each_bad_value_naming_the_field(spec):
    values = [BAD[spec.name]] + ([math.nan] if spec.kind is float else [])
    for value in values:
        with pytest.raises(fields.FieldError, match=rf"^{spec.name}: must be "):
            spec.check(value)
        if spec.server_default:  # the config's check is the same rule, under its section
            with pytest.raises(ConfigError, match=rf"^serve_defaults\.{spec.name}: must be "):
                RequestDefaults(**{spec.name: value})
    assert spec.check(spec.unset) == spec.unset  # OpenAI's default passes its own rule


def test_a_bad_value_over_grpc_and_http_names_the_field(tiny_served):
    """The one validation behind both front ends: each bad value is refused naming its field."""
    pb, _ = protos.load()
    validate = tiny_served
    for spec in FIELDS:
        value = BAD[spec.name]
        body = {"model": "m", "prompt": "ab", ("max_tokens" if spec.name == "max_new_tokens" else spec.name): value}
        requests = [schema.to_request(schema.CompletionBody(**body))]
        try:
            requests.append(from_proto(pb.GenerateRequest(text="ab", **{spec.name: value})))
        except ValueError:  # the wire type cannot carry it (a negative uint64 seed)
            assert spec.name == "seed"
        for request in requests:
            with pytest.raises(fields.FieldError) as refused:
                validate(request)
            assert refused.value.field == spec.name


def test_the_flags_set_the_command_s_value_and_the_server_s_default():
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_config_args(parser)
    given = {"max_new_tokens": "7", "temperature": "0.5", "top_k": "3", "top_p": "0.9", "min_p": "0.1",
             "seed": "11", "coupling": "gumbel"}
    assert set(given) == {f.name for f in fields.FLAGS}
    args = parser.parse_args([a for name, v in given.items() for a in (fields.BY_NAME[name].flag, v)])
    config = cli.config_from_args(args)
    for spec in fields.FLAGS:
        section = getattr(config, spec.section)
        assert getattr(section, spec.name) == spec.kind(given[spec.name]) == getattr(config.serve_defaults, spec.name)


@pytest.mark.parametrize("name", KNOBS)
def test_a_request_knob_is_named_in_at_most_four_runtime_files(name):
    runtime = [p for p in (ROOT / "ssd").rglob("*.py")
               if not {"tools", "_proto"} & set(p.relative_to(ROOT / "ssd").parts)]
    assert len(runtime) > 100
    naming = sorted(str(p.relative_to(ROOT)) for p in runtime if re.search(rf"\b{name}\b", p.read_text()))
    assert "ssd/fields.py" in naming and len(naming) <= MAX_FILES, naming


@pytest.fixture
def tiny_served(tiny_models, tiny_tokenizer):
    """validate(request) against a tiny local backend (AR: no plan to run) with the default options."""
    from ssd.config import Config
    from ssd.factory import LoadedPair
    from ssd.serve.backend import LocalBackend
    from ssd.serve.options import ServeOptions
    from ssd.serve.validation import validate

    target, draft = tiny_models
    backend = LocalBackend(Config(), pair=LoadedPair(target, draft, tiny_tokenizer))
    yield lambda request: validate(request, backend, ServeOptions())
    backend.close()
