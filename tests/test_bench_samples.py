"""launch/bench_samples.py's bench on the tiny pair (plain llama.cpp left out: no GGUF here);
the tiny tokenizer has no chat template, so a stand-in renders the message's characters mod 16."""

from __future__ import annotations

from ssd.config import load_config
from ssd.tools.bench import samples
from tests.conftest import ROOT


def test_samples_report_each_setup_and_our_engines_agree(monkeypatch):
    monkeypatch.setattr(samples, "chat_ids", lambda tokenizer, messages: [
        ord(ch) % 16 for m in messages for ch in m["content"]])
    config = load_config(ROOT / "configs" / "tiny.yaml", {"batching": {"prefill_chunk": 16}})
    result = samples.bench_samples(config, n=3, prompt_tokens=200, tokens=4, repeats=2, llamacpp=False)
    assert result["ours_agree"] and result["prompt_tokens"] <= 200
    rows = result["rows"]
    shared, alone = rows["ssd, one prefill copied to the rows"], rows["ssd, every row prefills"]
    assert alone[0]["fed"] == 3 * result["prompt_tokens"] > shared[0]["fed"] >= result["prompt_tokens"]
    assert "n = 3 samples" in samples.format_table(result)
