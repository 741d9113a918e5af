"""A chat's turns on the real target, with and without the prefix cache (ssd.engine.prefix),
beside plain llama.cpp with and without its server's prompt cache (`cache_prompt`).

Every engine holds its own conversation: a system message and the user turns below, each
turn's prompt the chat template over all earlier messages and the engine's own replies, so a
turn's prompt starts with the last one's. The engines take each turn in turn (interleaved,
the order rotating), one request at a time, greedy. Reported per engine: time to the first
token per turn (what the prefix cache saves), the whole turn's time, the prompt tokens it
fed and those it took from the cache; and whether our engines' replies agree token for token
(they must: the cache serves whole prompt chunks only). Engines with idle work prefill each
reply after its turn (Engine.warm, what the server does while the user reads), timed apart
from the turns. `mode="ssd"`: the engines run SSD (draft on a thread of this process), and a
third compares the draft's side of the cache: the speculator keeping released rows' caches
for the next turn (ssd.saguaro.speculator) against prefilling every prompt whole. Run it
with launch/bench_chat.py.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from ssd import hardware
from ssd.config import Config, GenerationConfig, SamplingConfig
from ssd.engine.batch import BatchedEngine
from ssd.engine.request import GenerationRequest
from ssd.factory import load_pair, make_engine
from ssd.models.backend import precision_of
from ssd.models.tokenizer import chat_ids

SYSTEM = ("You are a senior Python engineer reviewing a small command-line tool. Answer briefly, "
          "with code where it helps. The tool reads a CSV of orders (id, customer, amount, date), "
          "groups them by customer, and prints each customer's total and their largest order. "
          "It must run on Python 3.11 without third-party packages.")
TURNS = (
    "Write the function that reads the CSV into a list of dicts.",
    "Now group the orders by customer.",
    "Add each customer's total and largest order.",
    "How should it handle a malformed amount?",
    "Write a test for the grouping with pytest.",
    "Make the output sorted by total, largest first.",
)


def bench_chat(config: Config, chunks: Sequence[int], tokens: int, turns: Sequence[str] = TURNS,
               llamacpp: bool = True, chats: int = 1, mode: str = "ar") -> dict[str, Any]:
    """Per engine and turn: TTFT, the turn's seconds, prompt and cached tokens; our engines'
    replies compared. `chunks`: batching.prefill_chunk of the engines with the cache. `chats`:
    that many chats under the one system message take each turn in turn (chat k's messages
    name its project k), as users of one server do. `mode`: ar, or ssd (see above)."""
    pair = load_pair(config, with_draft=mode == "ssd")
    engines: dict[str, Callable[[GenerationRequest], Any]] = {}
    idle: dict[str, Callable[[], bool]] = {}  # the engines' idle work between turns (Engine.warm)
    opened: list[BatchedEngine] = []
    label = "ssd" if mode == "ar" else "ssd, SSD mode"

    def engine(batching: Any, draft_keeps: bool = True) -> BatchedEngine:
        made = make_engine(mode, pair, config.speculation, batching)
        if not draft_keeps:
            made.host.speculator.keep = 0
        opened.append(made)
        return made

    for chunk in chunks:
        batching = dataclasses.replace(config.batching, prefill_chunk=chunk, prefix_cache=True)
        for warm, keeps in ((False, True), (True, True)) + (((True, False),) if mode == "ssd" else ()):
            name = (f"{label}, prefix cache (chunk {chunk}){', reply prefilled while idle' if warm else ''}"
                    f"{'' if keeps else ', draft prefills whole prompts'}")
            made = engine(batching, keeps)
            engines[name] = made.generate
            if warm:
                idle[name] = made.warm
    plain = dataclasses.replace(config.batching, prefix_cache=False)
    engines[f"{label}, no cache (chunk {plain.prefill_chunk})"] = engine(plain).generate
    if llamacpp:
        from ssd.tools.bench.llamacpp import LlamaCppEngine, gguf_for

        gguf = gguf_for(config.target.name)
        threads = torch.get_num_threads()
        engines["llama.cpp, cache_prompt"] = LlamaCppEngine(gguf, threads, reuse_prefix=True).generate
        engines["llama.cpp, no cache"] = LlamaCppEngine(gguf, threads).generate
    histories = {name: [[{"role": "system", "content": SYSTEM}] for _ in range(chats)] for name in engines}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    replies: dict[str, list[list[int]]] = {name: [] for name in engines}
    generation, greedy = GenerationConfig(max_new_tokens=tokens), SamplingConfig(temperature=0.0)
    order = list(engines)
    for turn, chat, text in tqdm([(t, c, text) for t, text in enumerate(turns) for c in range(chats)], desc="turns"):
        for name in order[turn % len(order):] + order[: turn % len(order)]:  # each first in turn
            history = histories[name][chat]
            history.append({"role": "user", "content": text if chats == 1 else f"(Project {chat + 1}) {text}"})
            ids = chat_ids(pair.tokenizer, history)
            result = engines[name](GenerationRequest(ids, greedy, generation))
            history.append({"role": "assistant", "content": result.text})
            replies[name].append(list(result.token_ids))
            started = time.perf_counter()
            while name in idle and idle[name]():  # what the server does while the user reads
                pass
            s = result.stats
            rows[name].append({"turn": turn, "chat": chat, "prompt_tokens": len(ids), "cached_tokens": s.cached_prompt_tokens,
                               "ttft_s": s.time_to_first_token_s, "total_s": s.total_s, "new_tokens": s.new_tokens,
                               "idle_work_s": time.perf_counter() - started if name in idle else 0.0})
    for made in opened:
        made.close()
    ours = [replies[name] for name in engines if name.startswith("ssd")]
    return {"mode": mode, "machine": hardware.summary(), "uptime": hardware.uptime(), "threads": torch.get_num_threads(),
            "target": f"{config.target.name} ({precision_of(pair.target)})", "tokens": tokens, "turns": list(turns),
            "chats": chats, "rows": rows, "ours_agree": all(r == ours[0] for r in ours)}


def format_table(result: dict[str, Any]) -> str:
    """Per engine: TTFT per turn, the mean of turns after the first, the turns' total seconds."""
    chats = result.get("chats", 1)
    first = next(iter(result["rows"].values()))
    labels = [f"turn {r['turn'] + 1}" + (f" chat {r['chat'] + 1}" if chats > 1 else "") for r in first]
    lines = [f"{result['machine']}; {result['threads']} threads; mode {result.get('mode', 'ar')}; "
             f"target {result['target']}; "
             f"greedy, {result['tokens']} new tokens a turn; {chats} chat(s) under one system message; "
             f"uptime {result['uptime']}",
             "time to first token (s) per turn; prompt tokens fed / taken from the cache at the last turn",
             "| engine | " + " | ".join(labels)
             + " | mean TTFT, turns 2+ | all turns (s) | idle work (s) | last turn: prompt / cached |",
             "|---|" + "---|" * (len(labels) + 4)]
    for name, rows in result["rows"].items():
        later = [r["ttft_s"] for r in rows if r["turn"] > 0]
        lines.append(f"| {name} | " + " | ".join(f"{r['ttft_s']:.2f}" for r in rows)
                     + f" | {statistics.mean(later) if later else float('nan'):.2f} | "
                     f"{sum(r['total_s'] for r in rows):.1f} | {sum(r['idle_work_s'] for r in rows):.1f} | "
                     f"{rows[-1]['prompt_tokens']} / {rows[-1]['cached_tokens']} |")
    lines.append(f"our engines' replies agree token for token: {result['ours_agree']}")
    return "\n".join(lines)


def plot_turns(result: dict[str, Any], path: Path) -> Path:
    """Two panels over the turns, a line per engine: the time to the first token, and the whole
    turn's seconds (the Agg canvas: no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11.0, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    first, whole = fig.subplots(1, 2)
    for name, rows in result["rows"].items():
        turns = range(1, len(rows) + 1)
        first.plot(turns, [r["ttft_s"] for r in rows], marker="o", label=name)
        whole.plot(turns, [r["total_s"] for r in rows], marker="o")
    first.set(xlabel="turn (chats take each turn in turn)", ylabel="time to first token (s)", yscale="log")
    whole.set(xlabel="turn", ylabel="the turn's seconds")
    for ax in (first, whole):
        ax.grid(alpha=0.3)
    fig.suptitle(f"A chat's turns, mode {result.get('mode', 'ar')}: {result['target']}, {result['threads']} threads",
                 fontsize="medium")
    fig.legend(loc="outside lower center", fontsize="small", ncol=2)
    fig.savefig(path, dpi=110)
    return path
