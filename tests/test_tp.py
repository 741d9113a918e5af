"""Tensor-parallel target on real processes (gloo on loopback, 2 ranks x 1 thread).

TP=2 must reproduce TP=1: the same logits (up to summation order, in fp64) and
the same greedy tokens through the AR and SD engines, with rank 1 mirroring
rank 0's cache operations; both ranks run the lean forward sharded
(ssd.models.fast). The same world then checks every family the lean forward
takes (tests.families: qwen2, qwen3, llama, mistral) sharded against its
unsharded self and transformers' sharded forward. Every spawned world has a hard deadline, after
which its processes are killed, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ssd.config import GenerationConfig, ModelConfig, SamplingConfig, SpeculationConfig, TinyModelConfig
from ssd.engine import AREngine, SDEngine
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer
from ssd.models.kv import KVSequence
from ssd.models.loading import load_model
from tests.families import DRAFT_NOISE, FAMILIES, build_family, reference, tp_family_results
from tests.families import generations as family_generations
from ssd.models.tp import (
    TPLeader,
    TPSequence,
    init_tp_world,
    load_tp_model,
    pin_threads,
    run_tp_follower,
)

# fp64, not the fp32 TP runs in practice: TP=2 adds the ranks' partial sums in
# another order than TP=1's single dot product, which in fp32 moved logits by
# up to 1.5e-5 (a flaky 1e-5 tolerance) and could flip a greedy near-tie. The
# sharding, all-reduces and cache mirroring under test are the same in fp64.
TINY = TinyModelConfig(vocab_size=16, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, seed=0)
TARGET = ModelConfig(name="tiny", dtype="fp64", tiny=TINY)
DRAFT = ModelConfig(name="tiny", dtype="fp64", tiny=dataclasses.replace(TINY, noise=0.03))
# The logits tolerance, from the reduction order: reordering a sum of n terms
# moves it by at most ~n * eps * sum|terms|. fp32 showed 1.5e-5 on logits of
# magnitude ~8, i.e. ~2^8 eps(fp32) * |logit|; the same reordering in fp64 is
# ~2^8 * 2.2e-16 * 8 ~ 5e-13. Allowing 2^16 eps(fp64) * max|logit| (~1e-10)
# leaves a 256x margin for summation order and is still some 10^9 times
# smaller than what a wrong shard or a missing all-reduce does (O(0.1-1)).
REORDER_ULPS = 2**16
PROMPTS = [[1, 2, 3], [7, 7, 0, 1, 9, 12, 15]]
GREEDY = SamplingConfig(temperature=0.0)
NEW_TOKENS = 32
WORLD = 2
DEADLINE_S = 120.0  # far above a normal run (~15 s) but finite


def cache_script(seq: KVSequence | TPSequence) -> list[torch.Tensor]:
    """Prefill, decode, roll back, catch up: every cache operation the engines use."""
    seq.reset()
    out = [seq.forward([1, 2, 3, 4, 5])]  # prefill, all rows
    out += [seq.forward([t], last_only=True) for t in (6, 7, 8)]  # decode
    seq.rollback(4)
    out.append(seq.forward([9, 10, 11]))  # re-score after a rollback
    seq.trim_to_prefix_of([1, 2, 3, 4, 9, 0, 12])
    out.append(seq.catch_up([1, 2, 3, 4, 9, 0, 12])[None])
    return out


def generations(target: torch.nn.Module | TPLeader) -> list[list[int]]:
    """Greedy tokens of AR then SD (K = 3) on every prompt. The engines take the
    TP leader in place of the model; the draft is a plain local model (never TP)."""
    tok = TinyTokenizer.from_config(TINY)
    engines = [AREngine(target, tok), SDEngine(target, load_model(DRAFT), tok, SpeculationConfig(mode="sd", k=3))]
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return [engine.generate(GenerationRequest(p, GREEDY, gen)).token_ids for engine in engines for p in PROMPTS]


def _worker(rank: int, port: int, out_dir: str, scenario: str) -> None:
    """One target rank. Rank 0 runs `scenario` and saves what it saw; rank 1 follows."""
    pin_threads(rank, 1)
    logging.basicConfig(level=logging.INFO)
    init_tp_world(rank, WORLD, "127.0.0.1", port)
    model = load_tp_model(TARGET)
    if rank != 0:
        run_tp_follower(model)
        tp_family_results(rank)
        dist.destroy_process_group()
        return
    leader = TPLeader(model)
    if scenario == "crash":
        leader.sequence().forward([1, 2, 3])
        os._exit(3)  # die mid-session without OP_STOP, as a crashed leader would
    with leader:
        sequence = leader.sequence()
        # Refused arguments must raise before anything reaches the follower.
        for bad in (lambda: sequence.forward([]), lambda: sequence.rollback(99)):
            with pytest.raises(ValueError):
                bad()
        logits = cache_script(sequence)
        tokens = generations(leader)
        lean = sequence.lean
    shards = {name: tuple(local_tensor(p).shape) for name, p in model.named_parameters()}
    families = tp_family_results(rank)
    torch.save({"logits": logits, "tokens": tokens, "shards": shards, "lean": lean, "families": families},
               Path(out_dir) / "rank0.pt")
    dist.destroy_process_group()


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds (a DTensor's local shard)."""
    return p.to_local() if hasattr(p, "to_local") else p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(out_dir: Path, scenario: str, worker=None) -> list[int | None]:
    """Spawn the TP world running `worker(rank, port, out_dir, scenario)` (default: this
    module's); exit codes per rank, None for a rank killed at the deadline."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=worker or _worker, args=(r, port, str(out_dir), scenario)) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return codes


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("tp")
    codes = run_world(out, "main")
    assert codes == [0, 0], f"exit codes {codes} (None: killed at the {DEADLINE_S:.0f} s deadline)"
    return torch.load(out / "rank0.pt")


def test_tp_ranks_hold_shards(tp_run: dict) -> None:
    """TP really splits the model: without it the comparisons below compare TP=1 with itself."""
    full = {name: tuple(p.shape) for name, p in load_model(TARGET).named_parameters()}
    shards = tp_run["shards"]
    assert shards.keys() == full.keys()
    layer = "model.layers.0."
    for name, dim in [("self_attn.q_proj.weight", 0), ("self_attn.k_proj.weight", 0), ("mlp.up_proj.weight", 0),
                      ("self_attn.o_proj.weight", 1), ("mlp.down_proj.weight", 1)]:
        want = list(full[layer + name])
        want[dim] //= WORLD
        assert list(shards[layer + name]) == want, name
    assert sum(math.prod(s) for s in shards.values()) < 0.7 * sum(math.prod(s) for s in full.values())


def test_tp_logits_equal_tp1(tp_run: dict) -> None:
    assert tp_run["lean"]  # the sharded target runs the lean forward
    reference = cache_script(KVSequence(load_model(TARGET)))
    assert len(tp_run["logits"]) == len(reference)
    for got, want in zip(tp_run["logits"], reference):
        assert got.shape == want.shape and got.dtype == want.dtype == torch.float64  # the full vocabulary on rank 0
        tol = REORDER_ULPS * torch.finfo(torch.float64).eps * float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_tp_greedy_generation_equals_tp1(tp_run: dict) -> None:
    reference = generations(load_model(TARGET))
    assert all(len(t) == NEW_TOKENS for t in reference)
    assert tp_run["tokens"] == reference


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_lean_forward_gives_the_unsharded_logits(tp_run: dict, family: str) -> None:
    """Every family the lean forward takes, sharded: transformers' all-reduces inside
    the row-wise o_proj and down_proj, this rank's heads from the column-wise q/k/v."""
    seen = tp_run["families"][family]
    assert seen["lean"] and seen["leader_lean"] and seen["heads"] == 2  # 4 heads, 2 per rank: sharded
    want = reference(build_family(family))
    for got, hf, ref in zip(seen["logits"], seen["hf"], want, strict=True):
        tol = REORDER_ULPS * torch.finfo(torch.float64).eps * float(ref.abs().max())
        torch.testing.assert_close(got, ref, rtol=0, atol=tol)
        torch.testing.assert_close(got, hf, rtol=0, atol=tol)


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_greedy_sd_equals_ar_and_tp1(tp_run: dict, family: str) -> None:
    want = family_generations(build_family(family), build_family(family, noise=DRAFT_NOISE))
    assert tp_run["families"][family]["tokens"] == want


def test_follower_fails_fast_when_the_leader_dies(tmp_path: Path) -> None:
    start = time.monotonic()
    codes = run_world(tmp_path, "crash")
    assert codes[0] == 3
    # The follower's pending broadcast errors out (peer closed): not killed, not clean.
    assert codes[1] not in (None, 0), f"follower exit code {codes[1]}"
    assert time.monotonic() - start < DEADLINE_S
