"""Research ablations of SSD from recorded traces (launch/ablate.py).

Record once with the models (trace.py), then replay any fan-out schedule, K,
Saguaro C on the trace without them (replay.py), price the rounds with
measured costs (costs.py), search the grid (planner.py) and plot (plots.py).
"""

from ssd.tools.ablation.replay import ReplayData, ReplayResult, replay
from ssd.tools.ablation.trace import Trace, load_trace, record_trace, save_trace

__all__ = ["ReplayData", "ReplayResult", "Trace", "load_trace", "record_trace", "replay", "save_trace"]
