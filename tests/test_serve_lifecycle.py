"""Every way a request ends leaves one "finished" log line saying how."""

from __future__ import annotations

import logging

from tests.test_serve import (  # noqa: F401  (fixtures)
    PROMPT,
    ControlledBackend,
    backend,
    code_of,
    config,
    running,
    wait_until,
)


def test_cancel_and_deadline_are_logged_as_finished(backend, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger="ssd.serve.worker")
    with running(lambda: ControlledBackend(backend, round_delay_s=0.02)) as (_, client):
        call = client.stream(text=PROMPT, mode="ar", max_new_tokens=400, request_id="cancelled-one")
        for _ in range(3):
            next(call)
        call.cancel()
        code_of(lambda: client.generate(text=PROMPT, mode="ar", max_new_tokens=400, timeout=0.4,
                                        request_id="late-one"))
        client.generate(text=PROMPT, mode="ar", max_new_tokens=3, request_id="plain-one")
        assert wait_until(lambda: caplog.text.count("finished:") == 3), caplog.text
    assert "request cancelled-one finished: aborted (cancelled)" in caplog.text
    assert "request late-one finished: aborted (deadline)" in caplog.text
    assert "request plain-one finished: length, 3 tokens" in caplog.text


def test_invalid_utf8_is_invalid_argument_naming_the_field(backend):  # noqa: F811
    """protobuf refuses such strings before any handler runs; the server names the field."""
    import grpc

    def field(number: int, payload: bytes) -> bytes:  # a length-delimited field, by hand
        return bytes([number << 3 | 2, len(payload)]) + payload

    with running(lambda: ControlledBackend(backend)) as (_, client):
        generate = client.channel.unary_stream("/ssd.v1.GenerationService/Generate")
        abort = client.channel.unary_unary("/ssd.v1.GenerationService/Abort")
        cases = [
            (lambda: next(generate(field(2, b"ab\xffc"))), "text: not valid UTF-8"),
            (lambda: next(generate(field(2, b"ok") + field(10, b"x") + field(10, b"\xc3("))), "stop[1]: not valid UTF-8"),
            (lambda: next(generate(field(1, b"\xfe") + field(2, b"ok"))), "request_id: not valid UTF-8"),
            (lambda: abort(field(1, b"\xfe")), "request_id: not valid UTF-8"),
        ]
        for call, message in cases:
            code, details = code_of(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details == message
        assert client.generate(text=PROMPT, mode="ar", max_new_tokens=2).finish_reason == "length"  # still serving
