"""Load times of the int8 pair with and without the int8 cache (ssd.models.qcache), in one process.

For each model (target, then draft; one in memory at a time):
  uncached  load_model with model.cache_quantized off: read the fp32
            checkpoint and quantize (every start before the cache);
  first     the cache entry removed first: read, quantize and write the cache;
  warm      the cache present: read the int8 weights.
and whether the warm model's logits equal the uncached one's bit for bit.

    python launch/restart.py --json docs/results/restart.json

One intra-op thread by default, as a cluster actor pinned to one core has.
The fp32 checkpoint is read through the page cache when the host has the
memory to keep it, so "uncached" is the best case of a restart before.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import time
from pathlib import Path

import torch

from ssd import hardware
from ssd.app.cli import add_config_args, config_from_args
from ssd.config import ModelConfig
from ssd.models import load_model, qcache
from ssd.models.loading import _local_checkpoint, resolve_precision

IDS = torch.tensor([[755, 3974, 10405, 2890, 982, 262, 421, 2422]])  # a short code prompt's ids


def timed_load(cfg: ModelConfig) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    model = load_model(cfg)
    seconds = time.perf_counter() - started
    with torch.no_grad():
        logits = model(IDS).logits[0, -1].clone()
    del model
    gc.collect()
    return seconds, logits


def measure(role: str, cfg: ModelConfig) -> dict:
    cfg = resolve_precision(cfg)
    if cfg.quantization != "int8":
        raise SystemExit(f"{role} is not int8 on this host ({cfg.dtype}); the cache holds int8 weights only")
    source = _local_checkpoint(cfg.name)
    entry = qcache.entry_path(source)
    uncached, reference = timed_load(dataclasses.replace(cfg, cache_quantized=False))
    entry.unlink(missing_ok=True)
    first, _ = timed_load(cfg)
    warm, logits = timed_load(cfg)
    row = {"role": role, "model": cfg.name, "uncached_s": round(uncached, 2), "first_s": round(first, 2),
           "warm_s": round(warm, 2), "speedup": round(uncached / warm, 1),
           "checkpoint_gb": round(sum(f.stat().st_size for f in source.glob("*.safetensors")) / 1e9, 2),
           "cache_gb": round(entry.stat().st_size / 1e9, 2), "logits_identical": bool(torch.equal(logits, reference))}
    logging.info("%s", row)
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--roles", nargs="+", default=["target", "draft"], choices=["target", "draft"])
    parser.add_argument("--json", type=Path, help="write the rows and the machine here")
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    torch.set_num_threads(config.runtime.threads or 1)
    if not qcache.enabled():
        raise SystemExit(f"{qcache.ENV_SWITCH}=0 is set: nothing to measure")
    load_before = os.getloadavg()
    rows = [measure(role, getattr(config, role)) for role in args.roles]
    result = {"machine": hardware.describe(), "threads": torch.get_num_threads(),
              "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    print(f"machine: {hardware.summary()}; {torch.get_num_threads()} thread(s); "
          f"load average {result['loadavg_before']} -> {result['loadavg_after']}")
    print(f"{'role':<7} {'model':<30} {'uncached s':>10} {'first s':>8} {'warm s':>7} {'x':>5} "
          f"{'fp32 GB':>8} {'int8 GB':>8}  logits identical")
    for r in rows:
        print(f"{r['role']:<7} {r['model']:<30} {r['uncached_s']:>10.1f} {r['first_s']:>8.1f} {r['warm_s']:>7.1f} "
              f"{r['speedup']:>5.1f} {r['checkpoint_gb']:>8.2f} {r['cache_gb']:>8.2f}  {r['logits_identical']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")

