"""Tiny random models of each family the lean forward takes (qwen2, qwen3, llama, mistral).

Same shapes for all (16-token vocabulary, 2 layers, 4 query heads over 2 kv
heads, head dim 8), weights drawn under a fixed seed: every process that
builds one gets the same model. A draft is the same model with relative
weight noise, so speculative decoding accepts some tokens and rejects others.
"""

from __future__ import annotations

import torch

from ssd.config import GenerationConfig, SamplingConfig, SpeculationConfig, TinyModelConfig
from ssd.engine import AREngine, SDEngine
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer
from ssd.models.kv import KVSequence
from ssd.models.loading import _add_relative_noise
from tests.test_gpu_paths import script

FAMILIES = ("qwen2", "qwen3", "llama", "mistral")
VOCAB = 16
TOKENIZER = TinyModelConfig(vocab_size=VOCAB)  # TinyTokenizer.from_config(TOKENIZER)
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=False,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
PROMPTS = [[1, 2, 3], [7, 7, 0, 1, 9, 12, 15]]
NEW_TOKENS = 24
DRAFT_NOISE = 0.05


def family_config(family: str, **overrides):
    import transformers

    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[family]
    extra = {"sliding_window": None} if family == "mistral" else {}
    return cls(**{**SHAPE, **extra, **overrides})


def build_family(family: str, dtype: torch.dtype = torch.float64, noise: float = 0.0, seed: int = 0,
                 **overrides) -> torch.nn.Module:
    """A tiny `family` model (see the module docstring); noise > 0: a draft of it."""
    from transformers import AutoModelForCausalLM

    config = family_config(family, **overrides)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        if family == "qwen3":  # unit norms would make q_norm/k_norm's weights invisible
            for name, param in model.named_parameters():
                if "q_norm" in name or "k_norm" in name:
                    param.data.uniform_(0.5, 1.5)
    if noise:
        _add_relative_noise(model, noise, seed + 1)
    model.eval().requires_grad_(False)
    return model.to(dtype)


def reference(model) -> list[torch.Tensor]:
    """tests.test_gpu_paths.script's logits on transformers' own forward."""
    return script(KVSequence(model, fast=False))


def generations(target, draft) -> list[list[int]]:
    """Greedy tokens of AR then SD (K = 3) on every prompt."""
    tok = TinyTokenizer.from_config(TOKENIZER)
    engines = [AREngine(target, tok), SDEngine(target, draft, tok, SpeculationConfig(mode="sd", k=3))]
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    greedy = SamplingConfig(temperature=0.0)
    return [engine.generate(GenerationRequest(p, greedy, gen)).token_ids for engine in engines for p in PROMPTS]


def tp_family_results(rank: int) -> dict[str, dict]:
    """On each rank of a TP = 2 world: per family, the cache script on the sharded lean
    and transformers' carriers (both ranks run it: every forward is collective), then
    greedy AR and SD with rank 0 leading and rank 1 following. What rank 0 saw."""
    from ssd.models.tp import TPLeader, load_built_sharded, run_tp_follower

    seen = {}
    for family in FAMILIES:
        model = load_built_sharded(lambda: build_family(family), torch.float64, 2)
        lean = KVSequence(model)
        result = {"lean": lean.lean, "logits": script(lean), "hf": reference(model),
                  "heads": lean._fast.heads if lean.lean else None}
        if rank == 0:
            with TPLeader(model) as leader:
                result["tokens"] = generations(leader, build_family(family, noise=DRAFT_NOISE))
                result["leader_lean"] = leader.sequence().lean
            seen[family] = result
        else:
            run_tp_follower(model)
    return seen
