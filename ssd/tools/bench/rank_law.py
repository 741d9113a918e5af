"""The real pair's rank law: where the target's tokens rank among the draft's, for forced SSD hits.

    python -m ssd.tools.bench.rank_law --out configs/bench/rank_law_qwen2.5-coder.json
    python -m ssd.tools.bench.rank_law --config configs/X.yaml --tokens 128 --out F   # another pair

A forced draft (launch/gpu_bench.py's separate draft: random weights,
acceptance forced) says nothing about where a rejected position's t*, or
the bonus token, ranks among the draft's guesses, which is what decides
SSD's cache hits. This records it once from the configured real pair on the
CPU, the way the start-up plan does (ssd.saguaro.startup: the target's
greedy continuations of the sample prompts, then the draft teacher-forced
over them, `agreement`), with longer continuations for a steadier law. The
file is an ssd.saguaro.plan.Agreement (acceptance a, ranks_rejected,
ranks_bonus) with what made it; the bench keeps the ranks and puts its
forced acceptance in place of a.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any

import torch

from ssd.config import Config, load_config
from ssd.factory import load_pair
from ssd.models.backend import precision_of
from ssd.saguaro.startup import _continue_rows, agreement, sample_prompt_ids

log = logging.getLogger(__name__)

FORMAT = "ssd-rank-law/1"
DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "qwen2.5-coder-cpu.yaml"  # the real pair
DEFAULT_TOKENS = 96  # per sample prompt: ~300 positions in all, a minute or so on the 2-core CPU


def record(config: Config, tokens: int) -> dict[str, Any]:
    """The pair's Agreement over `tokens` greedy target tokens after each sample prompt, with its provenance."""
    started = time.perf_counter()
    pair = load_pair(config)
    prompts = sample_prompt_ids(pair.tokenizer)
    with torch.inference_mode():
        sequences = _continue_rows(pair.target, prompts, tokens)
        law = agreement(pair.draft, sequences, [len(p) for p in prompts])
    meta = {"target": config.target.name, "draft": config.draft.name, "target_precision": precision_of(pair.target),
            "draft_precision": precision_of(pair.draft), "prompts": len(prompts), "tokens_per_prompt": tokens,
            "temperature": 0.0, "seconds": round(time.perf_counter() - started, 1), "python": platform.python_version(),
            "torch": torch.__version__, "made_by": f"python -m ssd.tools.bench.rank_law --tokens {tokens}"}
    log.info("rank law: a = %.3f over %d positions (%d rejections)", law.a, law.positions, len(law.ranks_rejected))
    return {"format": FORMAT, "meta": meta, "agreement": law.to_json()}


def dumps(data: dict[str, Any]) -> str:
    """One line per field, each rank list on its own line (a small file that diffs well)."""
    def block(obj: dict[str, Any], indent: str) -> str:
        return "{\n" + ",\n".join(f'{indent}  "{k}": {json.dumps(v)}' for k, v in obj.items()) + f"\n{indent}}}"
    fields = {k: v for k, v in data.items() if k != "agreement"}
    head = ",\n".join(f'  "{k}": {json.dumps(v)}' for k, v in fields.items())
    return "{\n" + head + ',\n  "agreement": ' + block(data["agreement"], "  ") + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the pair (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="greedy target tokens per sample prompt")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = load_config(args.config)
    data = record(config, args.tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(data))
    print(f"wrote {args.out}: a = {data['agreement']['a']:.3f} over {data['agreement']['positions']} positions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
