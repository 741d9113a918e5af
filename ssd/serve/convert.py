"""Engine and server values -> ssd.v1 messages (the generated module is passed in)."""

from __future__ import annotations

from typing import Any

from ssd.config import BACKUPS, FANOUT_KINDS
from ssd.engine.metrics import GenerationStats
from ssd.serve.backend import BackendInfo
from ssd.serve.metrics import Counters
from ssd.serve.options import ServeOptions
from ssd.serve.protos import enum_values
from ssd.serve.validation import max_new_tokens_limit


def accepted_length_histogram(stats: GenerationStats) -> list[int]:
    """Drafting rounds by accepted length, from the per-position counts.

    Acceptance is a prefix, so rounds accepting >= j tokens are accepted_at[j-1]
    and rounds drafting anything are drafted_at[0].
    """
    if not stats.drafted_at:
        return []
    at_least = [stats.drafted_at[0], *stats.accepted_at, 0]
    return [at_least[j] - at_least[j + 1] for j in range(len(at_least) - 1)]


def spec_stats(pb: Any, stats: GenerationStats) -> Any:
    s = stats.spec
    return pb.SpecStats(
        lookups=s.lookups, hits=s.hits, hit_rate=s.hit_rate,
        lookups_by_k=s.lookups_by_k, hits_by_k=s.hits_by_k, backups=s.backups,
        tokens_per_round_after_hit=s.tokens_per_round_after_hit,
        tokens_per_round_after_miss=s.tokens_per_round_after_miss,
        target_wait_s=s.wait_s, verify_s=s.verify_s, build_s=s.build_s, backup_s=s.backup_s,
        degraded_rounds=s.degraded_rounds,
    )


def request_stats(pb: Any, stats: GenerationStats, queue_s: float, ttft_s: float, total_s: float) -> Any:
    return pb.RequestStats(
        mode=enum_values("Mode").get(stats.mode, 0), k=stats.k,
        prompt_tokens=stats.prompt_tokens, new_tokens=stats.new_tokens,
        queue_s=queue_s, time_to_first_token_s=ttft_s, total_s=total_s,
        tokens_per_s=stats.tokens_per_s, decode_tokens_per_s=stats.decode_tokens_per_s,
        rounds=stats.rounds, drafted=stats.drafted, accepted=stats.accepted,
        acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length,
        acceptance_by_position=stats.acceptance_by_position,
        accepted_length_histogram=accepted_length_histogram(stats),
        spec=spec_stats(pb, stats),
    )


def model_info(pb: Any, info: BackendInfo, options: ServeOptions) -> Any:
    return pb.ModelInfoResponse(
        target_model=info.target_model, draft_model=info.draft_model or "",
        vocab_size=info.vocab_size, modes=[enum_values("Mode")[m] for m in info.modes],
        backups=list(BACKUPS), fanout_kinds=list(FANOUT_KINDS),
        chat_template=info.chat_template, eos_token_ids=list(info.eos_token_ids),
        limits=_limits(pb, info, options), defaults=_defaults(pb, info, options),
    )


def _limits(pb: Any, info: BackendInfo, options: ServeOptions) -> Any:
    return pb.Limits(
        max_context_tokens=info.max_context_tokens, max_prompt_tokens=info.max_context_tokens - 1,
        max_new_tokens=max_new_tokens_limit(info, options),
        max_stop_strings=options.max_stop_strings, max_stop_chars=options.max_stop_chars,
        max_k=options.max_k, max_budget=options.max_budget, max_queue=options.max_queue,
        max_message_bytes=options.max_message_bytes,
    )


def _defaults(pb: Any, info: BackendInfo, options: ServeOptions) -> Any:
    d = info.defaults
    return pb.Defaults(
        mode=enum_values("Mode")[d.speculation.mode],
        max_new_tokens=min(d.generation.max_new_tokens, max_new_tokens_limit(info, options)),
        temperature=d.sampling.temperature, top_k=d.sampling.top_k, top_p=d.sampling.top_p,
        seed=d.sampling.seed, k=d.speculation.k, fanout_budget=d.speculation.fanout.budget,
        fanout_kind=d.speculation.fanout.kind, saguaro_c=d.speculation.saguaro_c,
        backup=d.speculation.backup,
    )


def stats_response(pb: Any, c: Counters, running: int, waiting: int, uptime_s: float, text: str) -> Any:
    g = c.generation
    return pb.StatsResponse(
        requests_total=c.requests_total, requests_running=running, requests_waiting=waiting,
        finished_by_reason=c.finished, requests_rejected=c.requests_rejected,
        prompt_tokens_total=g.prompt_tokens, generation_tokens_total=g.new_tokens,
        rounds_total=g.rounds, draft_tokens_total=g.drafted, accepted_tokens_total=g.accepted,
        spec_cache_lookups_total=g.spec.lookups, spec_cache_hits_total=g.spec.hits,
        spec_cache_hit_rate=g.spec.hit_rate, uptime_s=uptime_s, prometheus_text=text,
    )
