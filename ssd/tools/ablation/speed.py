"""SSD's modelled speed for a replayed schedule (the formula: ssd.saguaro.speed)."""

from __future__ import annotations

from ssd.saguaro.costs import Costs
from ssd.saguaro.speed import Speed, ssd_speed_from
from ssd.tools.ablation.replay import ReplayResult


def ssd_speed(result: ReplayResult, costs: Costs) -> Speed:
    """SSD's modelled speed for the schedule `result` replayed."""
    return ssd_speed_from(
        result.hit_rate, result.tokens_per_round_after_hit, result.tokens_per_round_after_miss,
        costs.verify(result.k), costs.backup(result.k), costs.build(result.k, result.budget), costs.ar_step_s,
    )
