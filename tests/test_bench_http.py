"""launch/bench_http.py on the tiny pair: both servers answer every probe, the table has a row each."""

from __future__ import annotations

from ssd.config import load_config
from ssd.tools.bench.http_latency import VARIANTS, bench_http, format_table
from tests.conftest import ROOT


def test_the_bench_times_every_request_on_both_sockets():
    result = bench_http(load_config(ROOT / "configs" / "tiny.yaml"), repeats=2, stream_tokens=4, prompt="abcab")
    names = ["health", "refused (400)", "1-token completion", "stream: first chunk", "stream: all of it"]
    for variant in VARIANTS:
        assert list(result["ms"][variant]) == names
        assert all(row["median"] > 0 for row in result["ms"][variant].values())
    table = format_table(result)
    assert all(f"| {name} |" in table for name in names)
