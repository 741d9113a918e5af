"""The benchmark: HF assisted generation as a like-for-like peer, report maths, files, the CLI."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch

from ssd.tools.bench import cli as bench_cli
from ssd.tools.ablation import contention
from ssd.tools.bench.hf_assisted import HFAssistedEngine, _dense_input, hf_generation_config
from ssd.tools.bench.llamacpp import LlamaCppEngine, gguf_for
from ssd.tools.prompts import Prompt, load_prompt_set
from ssd.tools.bench.report import (
    format_tables,
    physical_limit,
    plot_throughput,
    summarize,
    write_csv,
    write_json,
)
from ssd.tools.bench.runner import RunKey, Sample
from ssd.config import GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine.ar import AREngine
from ssd.engine.metrics import GenerationStats
from ssd.engine.request import GenerationRequest
from ssd.models.tokenizer import encode_prompt
from tests.conftest import ROOT

GREEDY = SamplingConfig()
PROMPTS = ["abcab", "ponm", "aaaabbbb"]


# ------------------------------------------------------------ HF assisted


def test_hf_assisted_greedy_equals_ar(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    gen = GenerationConfig(max_new_tokens=24)
    fields = ("num_assistant_tokens", "assistant_confidence_threshold")
    before = {n: getattr(draft.generation_config, n, None) for n in fields}
    hf = HFAssistedEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=4))
    for prompt in PROMPTS:
        ids = tiny_tokenizer.encode(prompt)
        expected = AREngine(target, tiny_tokenizer).generate(GenerationRequest(ids, GREEDY, gen)).token_ids
        result = hf.generate(GenerationRequest(ids, GREEDY, gen))
        assert result.token_ids == expected
        stats = result.stats
        assert stats.new_tokens == 24 and result.finish_reason == "length"
        assert 1 <= result.first_tokens <= 5
        assert 0 < stats.rounds and stats.accepted <= stats.drafted <= 4 * stats.rounds
        # Every token after the first round came from a round: accepted + 1 each.
        assert stats.accepted + stats.rounds == stats.new_tokens - result.first_tokens
        assert 0 < stats.time_to_first_token_s <= stats.total_s
    # The draft's own drafting policy is restored after each call, and no hook stays behind.
    assert {n: getattr(draft.generation_config, n, None) for n in before} == before
    for model in (target, draft):
        assert not model._forward_pre_hooks and not model.get_output_embeddings()._forward_pre_hooks


def test_lm_head_inputs_made_dense():
    """HF's sliced hidden states (size-1 batch dim with the full stride) become a dense copy."""
    hidden = torch.randn(1, 10, 4)
    view = hidden[:, -3:, :]
    (dense,) = _dense_input(None, (view,))
    assert dense.stride() == (12, 4, 1) and torch.equal(dense, view)
    assert _dense_input(None, (hidden,)) is None  # already dense: untouched


def test_hf_assisted_sampling_is_seeded(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    hf = HFAssistedEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=3))
    ids, gen = tiny_tokenizer.encode("abcab"), GenerationConfig(max_new_tokens=16)
    state = torch.get_rng_state()
    runs = [hf.generate(GenerationRequest(ids, SamplingConfig(temperature=0.7, seed=s), gen)).token_ids for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is left alone
    assert all(0 <= t < 16 for t in runs[2]) and len(runs[2]) == 16
    # The seed (and the temperature) act: another seed samples another output, and
    # none of them is the greedy one.
    greedy = hf.generate(GenerationRequest(ids, GREEDY, gen)).token_ids
    assert runs[2] != runs[0] and greedy not in runs


def test_hf_generation_config_matches_our_sampling():
    sampling = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)
    sampled = hf_generation_config(sampling, GenerationConfig(max_new_tokens=7), {3, 1})
    assert (sampled.do_sample, sampled.temperature, sampled.top_k, sampled.top_p) == (True, 0.7, 5, 0.9)
    assert sampled.repetition_penalty == 1.0 and sampled.max_new_tokens == 7
    assert sampled.eos_token_id == [1, 3] and sampled.pad_token_id == 1
    greedy = hf_generation_config(GREEDY, GenerationConfig(), set())
    assert greedy.do_sample is False and greedy.eos_token_id is None and greedy.pad_token_id is None


# ------------------------------------------------------------ prompts


class _ChatTokenizer:
    """A tokenizer with a chat template: renders '<u>text</u>' and encodes one id per character."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert add_generation_prompt and not tokenize
        return "".join(f"<u>{m['content']}</u>" for m in messages)

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def test_chat_prompts_use_the_template_when_there_is_one(tiny_tokenizer):
    chat = _ChatTokenizer()
    assert encode_prompt(chat, "hi", chat=True) == [ord(c) for c in "<u>hi</u>"]
    assert encode_prompt(chat, "hi") == [ord("h"), ord("i")]
    # No template (the tiny tokenizer): the text as is.
    assert Prompt("abc", chat=True).encode(tiny_tokenizer) == tiny_tokenizer.encode("abc")


def test_prompt_set_formats(tmp_path):
    plain = tmp_path / "plain.yaml"
    plain.write_text('- "abc"\n- chat: "hello"\n- text: "x"\n')
    assert load_prompt_set(plain) == [Prompt("abc"), Prompt("hello", True), Prompt("x")]
    flagged = tmp_path / "flagged.yaml"
    flagged.write_text('chat: true\nprompts: ["a", "b", "c"]\n')
    assert load_prompt_set(flagged, limit=2) == [Prompt("a", True), Prompt("b", True)]
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {chat: a, text: b}\n")
    with pytest.raises(ValueError, match="a prompt must be"):
        load_prompt_set(bad)


def test_repo_prompt_sets():
    code = load_prompt_set(ROOT / "configs" / "prompts" / "code.yaml")
    chat = load_prompt_set(ROOT / "configs" / "prompts" / "chat.yaml")
    assert len(code) >= 8 and not any(p.chat for p in code)
    assert len(chat) >= 8 and all(p.chat for p in chat)


# ------------------------------------------------------------ report maths


def _sample(new_tokens, ttft, total, rounds=0, accepted=0, k=0, verify_s=0.0, hits=0, lookups=0, first=1):
    stats = GenerationStats(mode="x", k=k, new_tokens=new_tokens, time_to_first_token_s=ttft, total_s=total)
    for i in range(rounds):
        stats.record_round(drafted=k, accepted=accepted // rounds + (i < accepted % rounds))
    stats.target_s = verify_s
    stats.spec.hits, stats.spec.lookups = hits, lookups
    return Sample(0, stats, [], first)


def _synthetic():
    """code / T=0: AR 10 tok/s at 1 thread, 20 at 2; SD 24 at 1, 40 at 2; SSD 50 with 5 tok/round,
    0.08 s verify; HF 30."""
    key = lambda mode, k=0, threads=0, cluster=False: RunKey("code", 0.0, mode, k, threads, cluster)  # noqa: E731
    return {
        key("ar", threads=1): [_sample(11, 1.0, 2.0, rounds=10)],
        key("ar", threads=2): [_sample(11, 0.5, 1.0, rounds=10), _sample(21, 0.5, 1.5, rounds=20)],
        key("sd", 4, threads=1): [_sample(25, 0.5, 1.5, rounds=6, accepted=18, k=4, verify_s=0.5)],
        key("sd", 4, threads=2): [_sample(41, 0.5, 1.5, rounds=10, accepted=30, k=4, verify_s=0.5)],
        key("ssd", 4, cluster=True): [
            _sample(51, 0.5, 1.5, rounds=10, accepted=40, k=4, verify_s=0.8, hits=9, lookups=10)
        ],
        key("hf", 4, threads=2): [_sample(35, 2.0, 3.0, rounds=6, accepted=24, k=4, first=5)],
    }


def test_report_ratios_and_physical_limit():
    rows, limits = summarize(_synthetic())
    by = {r["label"]: r for r in rows}
    assert [r["mode"] for r in rows] == ["ar", "ar", "sd", "sd", "ssd", "hf"]
    assert by["ar t=1"]["tok_s"] == pytest.approx(10)
    assert by["ar t=2"]["tok_s"] == pytest.approx(20)  # 30 tokens over 1.5 s, pooled
    assert by["ar t=1"]["x_ar"] == pytest.approx(0.5)  # against the best AR (2 threads)
    assert by["sd K=4 t=2"]["x_ar"] == pytest.approx(2.0)
    ssd = by["ssd K=4 cluster"]
    assert (ssd["tok_s"], ssd["x_sd"], ssd["threads"]) == (pytest.approx(50), pytest.approx(1.25), "1+1")
    assert ssd["x_sd1"] == pytest.approx(50 / 24)  # the paper's setting: SD on the target's one core
    assert ssd["accepted_len"] == pytest.approx(4.0) and ssd["tokens_per_round"] == pytest.approx(5.0)
    assert ssd["hit_rate"] == pytest.approx(0.9) and ssd["t_verify_ms"] == pytest.approx(80)
    hf = by["hf K=4 t=2"]  # 30 tokens after the first round's 5, over 1 s
    assert hf["tok_s"] == pytest.approx(30) and hf["hit_rate"] is None and hf["ttft_ms"] == pytest.approx(2000)
    limit = limits[("code", 0.0)]
    assert limit.source == "ssd K=4 cluster" and limit.tok_s == pytest.approx(5.0 / 0.08)
    assert ssd["x_limit"] == pytest.approx(50 / 62.5)
    assert by["ar t=1"]["accepted_len"] is None and by["ar t=1"]["x_limit"] == pytest.approx(10 / 62.5)


def test_rows_name_their_precision_and_the_machine():
    results = _synthetic()
    for samples in results.values():
        samples[0].stats.precision = "target int8, draft bf16"
    rows, limits = summarize(results)
    assert {r["precision"] for r in rows} == {"int8/bf16"}
    table = format_tables(rows, limits)
    assert table.splitlines()[0].startswith("machine: ") and "torch CPU capability" in table
    assert "int8/bf16" in table and "x SD1" in table


def test_llama_cpp_peer_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    with pytest.raises(RuntimeError, match=r"ssd\[llamacpp\]"):
        LlamaCppEngine(ROOT / "missing.gguf")
    with pytest.raises(ValueError, match="no GGUF file"):
        gguf_for("tiny")


def test_physical_limit_falls_back_to_sd_then_none():
    results = {k: v for k, v in _synthetic().items() if k.mode != "ssd"}
    rows, limits = summarize(results)
    assert limits[("code", 0.0)].source == "sd K=4 t=2"
    assert limits[("code", 0.0)].tok_s == pytest.approx(4.0 / 0.05)
    assert physical_limit([r for r in rows if r["mode"] == "ar"]) is None


def test_json_csv_png_written(tmp_path):
    results = _synthetic()
    rows, limits = summarize(results)
    write_json(tmp_path / "b.json", results, rows, limits, {"modes": ["ar"]})
    write_csv(tmp_path / "b.csv", rows)
    plot_throughput(tmp_path / "b.png", rows, limits)
    data = json.loads((tmp_path / "b.json").read_text())
    assert {"machine", "settings", "aggregates", "limits", "runs"} <= data.keys()
    assert data["machine"]["cpu_count"] and data["machine"]["torch_version"]
    assert data["machine"]["cpu_model"] and data["machine"]["torch_cpu_capability"]
    assert len(data["runs"]) == 6 and data["runs"][0]["samples"][0]["stats"]["new_tokens"] == 11
    table = list(csv.DictReader((tmp_path / "b.csv").open()))
    assert len(table) == 6 and table[0]["hit_rate"] == "" and float(table[4]["hit_rate"]) == pytest.approx(0.9)
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------ the CLI, end to end


def test_bench_cli_end_to_end(tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "mixed.yaml"
    prompts.write_text('- "abcab"\n- chat: "ponm"\n')
    out = {ext: tmp_path / f"bench.{ext}" for ext in ("json", "csv", "png")}
    results = bench_cli.main([
        "--config", str(ROOT / "configs" / "tiny.yaml"), "--modes", "ar", "sd", "hf",
        "--prompt-sets", "tiny", str(prompts), "--prompts", "2", "--temperatures", "0", "0.7",
        "--max-new-tokens", "12", "--thread-counts", "1", "--no-progress", "--log-level", "WARNING",
        "--json", str(out["json"]), "--csv", str(out["csv"]), "--plot", str(out["png"]), "--background-load",
    ])
    printed = capsys.readouterr().out
    assert "background load: one busy process at nice 19" in printed  # every table says which condition
    for title in ("prompt set 'tiny', temperature 0:", "prompt set 'mixed', temperature 0.7:"):
        assert title in printed
    assert "physical limit" in printed and "x limit" in printed
    assert len(results) == 2 * 2 * 3  # prompt sets x temperatures x modes
    for set_name in ("tiny", "mixed"):  # greedy: every mode emits AR's tokens
        greedy = {
            k.mode: [s.token_ids for s in v]
            for k, v in results.items() if k.prompt_set == set_name and k.temperature == 0
        }
        assert greedy["sd"] == greedy["ar"] == greedy["hf"]
    assert len(list(csv.DictReader(out["csv"].open()))) == 12
    settings = json.loads(out["json"].read_text())["settings"]
    assert settings["temperatures"] == [0.0, 0.7] and settings["background_load"] is True
    assert out["png"].stat().st_size > 1000


def test_contention_cli_times_the_target_alone_and_beside_a_busy_draft(monkeypatch, capsys):
    monkeypatch.setattr("os.sched_setaffinity", lambda pid, cores: None)  # CI may have one core
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    contention.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--repeats", "2"])
    line = capsys.readouterr().out
    assert "alone" in line and "draft busy on core 1" in line and "-> x" in line


def test_contention_cli_refuses_a_shared_core(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        contention.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--draft-core", "0"])
    assert "--target-core and --draft-core must differ" in capsys.readouterr().err


# ------------------------------------------------------------ quality of a precision


def test_precision_rows_compare_speed_and_quality_on_the_same_positions():
    from ssd.tools.bench.precision import compare, format_rows
    from ssd.config import ModelConfig, TinyModelConfig
    from ssd.models import load_model

    tcfg = TinyModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, seed=4)
    ids = torch.randint(0, 32, (97,), generator=torch.Generator().manual_seed(0)).tolist()
    loaders = {
        "fp32": lambda: load_model(ModelConfig(name="tiny", tiny=tcfg)),
        "int8": lambda: load_model(ModelConfig(name="tiny", quantization="int8", tiny=tcfg)),
        "other": lambda: load_model(ModelConfig(name="tiny", tiny=TinyModelConfig(vocab_size=32, seed=9))),
    }
    rows = {r["precision"]: r for r in compare(loaders, ids, chunk=32, progress=False, k=3)}
    assert all(r["positions"] == 96 for r in rows.values())
    assert rows["fp32"]["agreement_vs_fp32"] == 1.0 and rows["fp32"]["perplexity_delta"] == 0.0
    # int8 agrees with its fp32 model far more than an unrelated model does
    assert rows["int8"]["agreement_vs_fp32"] > 0.8 > rows["other"]["agreement_vs_fp32"]
    assert abs(rows["int8"]["perplexity_delta"]) < abs(rows["other"]["perplexity_delta"])
    assert all(r["step_ms"] > 0 and r["verify_ms"] > 0 and r["k"] == 3 for r in rows.values())
    table = format_rows(list(rows.values()))
    assert "agree int8" in table and "verify 4 ms" in table
