"""launch/bench_kv.py's bench on the tiny Q4_K_M model (tests/test_llamacpp.py), its ids a
stand-in for real text: each cache's exactness, step times, errors and decode rates reported."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

import ssd.models.tokenizer as tokenizer_module  # noqa: E402
import ssd.tools.bench.llamacpp as peer_module  # noqa: E402
from ssd.config import load_config  # noqa: E402
from ssd.models import TinyTokenizer  # noqa: E402
from ssd.tools.bench import kv_cache  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.test_llamacpp import CFG, k_quant_files  # noqa: E402,F401 - the fixture


def test_each_cache_is_reported_and_only_f16_parts_rows(k_quant_files, monkeypatch):
    monkeypatch.setattr(peer_module, "gguf_for", lambda name: k_quant_files[0])
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", lambda cfg: TinyTokenizer(CFG.vocab_size))
    monkeypatch.setattr(kv_cache, "long_text_ids", lambda tok, n: [(7 * i + 3) % CFG.vocab_size for i in range(n)])
    result = kv_cache.bench_kv(load_config(ROOT / "configs" / "tiny.yaml"), [300], repeats=1, prompt_tokens=300,
                               tokens=4)
    assert result["exact"] == {"f16": False, "bf16/f16": True, "bf16": True} and result["probe_picks"] == "bf16/f16"
    assert all(result["step_ms"][kv][300] > 0 and result["error"][kv][300]["mean_kl"] >= 0 for kv in kv_cache.CACHES)
    assert set(result["decode"]) == {"ours, bf16/f16", "ours, bf16", "llama.cpp (F16 cache)"}
    table = kv_cache.format_table(result)
    assert "| bf16/f16 | yes |" in table and "| f16 | no |" in table
