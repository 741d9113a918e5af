"""The serving load generator: what it counts, against a real server on loopback."""

from __future__ import annotations

import pytest

from ssd.tools.bench.load import LoadResult, Timeline, format_load_table, run_load
from ssd.config import load_config
from ssd.serve.options import ServeOptions
from ssd.openai.server import serve_config
from tests.conftest import ROOT


def test_a_round_of_several_tokens_shares_its_gap():
    timeline = Timeline(sent=0.0, arrivals=[(0.5, 1), (0.7, 1), (1.1, 4)])
    assert timeline.tokens == 6 and timeline.ttft == 0.5
    assert timeline.token_gaps() == pytest.approx([0.2, 0.1, 0.1, 0.1, 0.1])


def test_the_table_gives_throughput_relative_to_the_first_row_of_each_concurrency():
    rows = [LoadResult("ar", 1, 2, 100, 10.0, [0.1], [0.01], []), LoadResult("sd", 1, 2, 100, 5.0, [0.1], [0.01], [])]
    table = format_load_table(rows)
    assert "| sd | 1 | 2 | 100 | 20.0 | 2.00 |" in table


def test_concurrent_clients_against_a_real_server():
    config = load_config(ROOT / "configs" / "tiny.yaml")
    server = serve_config(config, ServeOptions(port=0), with_draft=False)
    try:
        assert server.wait_ready(60)
        result = run_load(f"127.0.0.1:{server.port}", "ar", concurrency=3, prompts=["abcab", "ponm"],
                          requests_per_client=2, request_fields={"max_new_tokens": 12, "mode": "ar"})
    finally:
        server.stop()
    assert result.errors == [] and result.requests == 6 and result.tokens == 6 * 12
    assert len(result.ttft) == 6 and len(result.gaps) == 6 * 11  # a gap per token after the first
    assert result.throughput > 0 and result.row()["itl_p99_ms"] >= result.row()["itl_p50_ms"]


def test_the_serving_bench_compares_batched_modes_with_the_one_at_a_time_server(tmp_path, capsys):
    from ssd.tools.bench import cli as bench

    prompts = tmp_path / "tiny.yaml"
    prompts.write_text("- abcab\n- ponm\n- aaaabbbb\n")
    results = bench.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--prompt-file", str(prompts),
                          "--concurrency", "1", "3", "--modes", "ar", "sd", "--max-new-tokens", "12", "--no-progress",
                          "--adaptive"])
    table = capsys.readouterr().out
    labels = [r.label for r in results]
    assert labels == ["sd one-at-a-time", "ar batched", "sd K=4 batched", "sd adaptive"] * 2
    assert all(not r.errors and r.tokens == r.requests * 12 for r in results)
    assert "| 3 | sd K=4 batched |" in table and "| 1 | sd one-at-a-time |" in table
    assert "k_policy = {" in table  # the calibrated policy the adaptive row ran with


@pytest.mark.cluster
def test_the_serving_bench_runs_ar_and_ssd_through_the_cluster_beside_in_process_rows(shared_ray, tmp_path, capsys):
    from ssd.tools.bench import cli as bench

    prompts = tmp_path / "tiny.yaml"
    prompts.write_text("- abcab\n- ponm\n")
    results = bench.main(["--config", str(ROOT / "configs" / "tiny-cluster.yaml"), "--prompt-file", str(prompts),
                          "--concurrency", "1", "2", "--cluster", "--modes", "ar", "sd", "--thread-counts", "1",
                          "--max-new-tokens", "8", "--requests-per-client", "1", "--no-progress"])
    out = capsys.readouterr().out
    labels = [r.label for r in results]
    assert labels == ["ar batched cluster", "ssd batched cluster", "ar batched t=1", "sd K=4 batched t=1"] * 2
    assert all(not r.errors and r.tokens == r.requests * 8 for r in results)
    assert "cluster: SSD runs with K=4" in out and "| 2 | ssd batched cluster | " in out
