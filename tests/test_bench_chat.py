"""launch/bench_chat.py's bench on the tiny pair: two chats under one system message, our
engines with and without the prefix cache (plain llama.cpp left out: no GGUF here); the tiny
tokenizer has no chat template, so a stand-in renders each message's characters mod 16."""

from __future__ import annotations

from ssd.config import load_config
from ssd.tools.bench import chat_turns
from tests.conftest import ROOT


def test_two_chats_report_each_turn_and_our_engines_agree(monkeypatch):
    monkeypatch.setattr(chat_turns, "chat_ids", lambda tokenizer, messages: [
        ord(ch) % 16 for m in messages for ch in m["content"][:40]])
    config = load_config(ROOT / "configs" / "tiny.yaml")
    result = chat_turns.bench_chat(config, [8], tokens=4, turns=chat_turns.TURNS[:2], llamacpp=False, chats=2)
    assert result["ours_agree"] and result["chats"] == 2
    rows = result["rows"]
    assert list(rows) == ["ssd, prefix cache (chunk 8)", "ssd, prefix cache (chunk 8), reply prefilled while idle",
                          "ssd, no cache (chunk 512)"]
    cached = rows["ssd, prefix cache (chunk 8), reply prefilled while idle"]
    assert [(r["turn"], r["chat"]) for r in cached] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert cached[1]["cached_tokens"] > 0  # the second chat's first turn: the shared system message
    assert all(r["cached_tokens"] == 0 for r in rows["ssd, no cache (chunk 512)"])
    table = chat_turns.format_table(result)
    assert "turn 2 chat 2" in table and "2 chat(s) under one system message" in table
