"""Token frequencies on text the project ships, for the draft's vocabulary subset (FR-Spec).

    python launch/vocab_rank.py                      # the draft's tokenizer over DEFAULT_SOURCES
    python launch/vocab_rank.py --sources 'docs/*.md' --out ranking.json
    python launch/vocab_rank.py --sweep --backend torch --target-precision int8 --draft-precision int8
    python launch/vocab_rank.py --step 8192 16384 32768 --backend torch --draft-precision int8 --threads 1

--sweep: acceptance against the subset's size on the shipped prompt sets
(configs/prompts code and chat): the target's greedy continuation of each
prompt (--max-new-tokens), then, teacher-forced on it, the draft's top-1
agreement with the target (greedy acceptance) and sum min(p, q) at T = 0.7
(sampled acceptance, Leviathan et al. 2023) with q restricted to each size's
subset (restricted logits are the full head's rows: ssd.models.vocab).

--step: the draft's one-token decode step with the full head and with each
subset size, against its weights-read floor: the bytes of weights a step
reads (every Linear's, the norms', one embedding row) over the read
bandwidth of the same threads (--threads, default 1: the max of a 512 MB
int8 buffer).

Counts the tokens of every file the source globs match (relative to the
repository root) with the draft's tokenizer, one file at a time under a
progress bar, and writes the ids most frequent first
(ssd.models.vocab.write_ranking). The prompt sets (configs/prompts) are left
out by default: the subset's size is chosen by acceptance on them
(`launch/vocab_rank.py --sweep`), so they stay out of the ranking.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from tqdm import tqdm

from ssd.app.cli import ROOT, add_config_args, config_from_args
from ssd.models import load_tokenizer
from ssd.models.kv import KVSequence
from ssd.models.vocab import SubsetHead, model_eos_ids, read_ranking, subset_ids, write_ranking

log = logging.getLogger("vocab_rank")

# The project's own code and prose: Python in the package, tests and launch
# scripts; the docs and README. Code and English, the two kinds of text the
# shipped prompt sets ask for.
DEFAULT_SOURCES = ("ssd/**/*.py", "launch/*.py", "tests/*.py", "docs/**/*.md", "README.md")
DEFAULT_OUT = ROOT / "configs" / "vocab" / "qwen2.5-coder.json"
KEEP = 32768  # ids written: more than any subset the sweep considers


def source_files(patterns: Sequence[str], root: Path = ROOT) -> list[Path]:
    files = sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()})
    if not files:
        raise SystemExit(f"no file matches {list(patterns)} under {root}")
    return files


def count_tokens(tokenizer: Any, files: Iterable[Path]) -> Counter:
    """Token counts over the files' text, one progress-bar step per file."""
    counts: Counter = Counter()
    files = list(files)
    for path in tqdm(files, desc="counting tokens", unit="file"):
        counts.update(tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False))
    return counts


def ranking_of(counts: Counter, keep: int = KEEP) -> list[int]:
    """Ids most frequent first (ties: lower id first), at most `keep`."""
    return [token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:keep]]


SWEEP_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_TEMPERATURE = 0.7


def continuations(target: Any, prompts: Sequence[list[int]], n: int) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's greedy continuation by the target: (ids, the target's logits before each) [n, V]."""
    out = []
    for prompt in tqdm(prompts, desc="target continuations", unit="prompt"):
        seq = KVSequence(target)
        row = seq.forward(prompt, last_only=True)[-1]
        ids, rows = [], []
        for _ in range(n):
            rows.append(row.float())
            ids.append(int(row.argmax()))
            row = seq.forward([ids[-1]])[-1]
        out.append((ids, torch.stack(rows)))
    return out


def acceptance_by_size(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, tokens: torch.Tensor, subsets: dict[str, list[int] | None],
) -> dict[str, tuple[float, float]]:
    """{size: (greedy agreement, mean sum min(p, q) at SWEEP_TEMPERATURE)} over the rows."""
    p = torch.softmax(target_logits.double() / SWEEP_TEMPERATURE, dim=-1)
    result = {}
    for name, ids in subsets.items():
        logits = draft_logits.double()
        if ids is not None:
            masked = torch.full_like(logits, float("-inf"))
            masked[:, ids] = logits[:, ids]
            logits = masked
        greedy = float((logits.argmax(dim=-1) == tokens).double().mean())
        q = torch.softmax(logits / SWEEP_TEMPERATURE, dim=-1)
        result[name] = (greedy, float(torch.minimum(p, q).sum(dim=-1).mean()))
    return result


def sweep(config: Any, ranking: list[int], n_tokens: int) -> dict[str, tuple[float, float]]:
    from ssd.factory import load_pair
    from ssd.tools.prompts import load_prompt_set

    pair = load_pair(config)
    prompts = [p.encode(pair.tokenizer) for name in ("code", "chat")
               for p in load_prompt_set(ROOT / "configs" / "prompts" / f"{name}.yaml")]
    vocab = pair.draft.config.vocab_size
    subsets: dict[str, list[int] | None] = {
        str(n): subset_ids(ranking, n, vocab, model_eos_ids(pair.draft)) for n in SWEEP_SIZES if n < vocab
    }
    subsets["full"] = None
    drafts, targets, tokens = [], [], []
    for prompt, (ids, rows) in zip(prompts, continuations(pair.target, prompts, n_tokens)):
        logits = KVSequence(pair.draft).forward(prompt + ids[:-1])[len(prompt) - 1 :]
        drafts.append(logits.float())
        targets.append(rows)
        tokens.append(torch.tensor(ids))
    return acceptance_by_size(torch.cat(drafts), torch.cat(targets), torch.cat(tokens), subsets)


STEP_CONTEXT = 200  # cached tokens before the timed steps
STEP_REPEATS = 80  # timed steps per variant
STEP_ROUNDS = 8


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every Linear's (int8, float or a GGUF
    kernel layer's blocks), the norms'; the embedding table contributes one row."""
    from ssd.models.quant import FusedInt8Linear, Int8Linear

    total, packed = 0, set()
    for module in model.modules():
        if type(module).__name__ == "QLinear":  # GGUF kernels: packed blocks, shared by fused and separate layers
            for fmt, blocks in module.parts():
                if blocks.data_ptr() not in packed:
                    packed.add(blocks.data_ptr())
                    total += blocks.numel()
        elif isinstance(module, Int8Linear):
            total += module.out_features * module.in_features
        elif isinstance(module, FusedInt8Linear):
            continue  # its parts are Int8Linear modules, counted above
        elif isinstance(module, torch.nn.Embedding):
            total += module.weight.shape[1] * module.weight.element_size()
        else:
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second torch's threads read (the max of an int8 buffer, best of `repeats`)."""
    buffer = torch.ones(megabytes << 20, dtype=torch.int8)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.max()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() / best


def step_table(config: Any, ranking: list[int], sizes: Sequence[int]) -> list[tuple[str, float, int]]:
    """(head, median step seconds, weight bytes read) for the full head and each subset size.

    One model, its head swapped between the variants; the variants' steps
    interleave (STEP_ROUNDS rounds of a few steps each), so a load that
    moves during the run moves every variant alike.
    """
    from ssd.models import load_model

    model = load_model(config.draft)
    vocab, full = model.config.vocab_size, model.lm_head
    heads = {"full": full}
    for size in sizes:
        heads[str(size)] = SubsetHead(full, subset_ids(ranking, size, vocab, model_eos_ids(model)), vocab)
    seq = KVSequence(model)
    seq.forward(list(range(1000, 1000 + STEP_CONTEXT)), last_only=True)
    times: dict[str, list[float]] = {name: [] for name in heads}
    for round_index in range(STEP_ROUNDS):
        for name, head in heads.items():
            model.lm_head = head
            for i in range(STEP_REPEATS // STEP_ROUNDS):
                started = time.perf_counter()
                seq.forward([2000 + i])
                times[name].append(time.perf_counter() - started)
                seq.rollback(STEP_CONTEXT)
    rows = []
    for name, head in heads.items():
        model.lm_head = head
        rows.append((name, statistics.median(times[name]), weight_bytes(model)))
    model.lm_head = full
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--sources", nargs="+", default=list(DEFAULT_SOURCES), help="globs under the repository root")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the ranking file to write (read by --sweep)")
    parser.add_argument("--sweep", action="store_true", help="acceptance against the subset size on the prompt sets")
    parser.add_argument("--step", type=int, nargs="*", metavar="SIZE",
                        help="time the draft's decode step with the full head and these subset sizes, against "
                             "its weights-read floor (bytes read / one thread's read bandwidth)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = config_from_args(args)
    if args.step is not None:
        torch.set_num_threads(config.runtime.threads or 1)  # the bandwidth and the steps on the same threads
        bandwidth = read_bandwidth()
        print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads); step after {STEP_CONTEXT} tokens, "
              f"median of {STEP_REPEATS}")
        print(f"{'head':>6}  {'step ms':>8}  {'weights MB':>10}  {'floor ms':>8}  {'x floor':>7}")
        for name, seconds, nbytes in step_table(config, read_ranking(args.out), args.step):
            floor = nbytes / bandwidth
            print(f"{name:>6}  {1e3 * seconds:8.1f}  {nbytes / 1e6:10.0f}  {1e3 * floor:8.1f}  {seconds / floor:7.2f}")
        return
    if args.sweep:
        rows = sweep(config, read_ranking(args.out), config.generation.max_new_tokens)
        print(f"{'size':>6}  greedy agreement  sum min(p,q) T={SWEEP_TEMPERATURE}")
        for name, (greedy, sampled) in rows.items():
            print(f"{name:>6}  {greedy:16.3f}  {sampled:18.3f}")
        return
    tokenizer = load_tokenizer(config.draft)
    files = source_files(args.sources)
    counts = count_tokens(tokenizer, files)
    ranking = ranking_of(counts)
    write_ranking(args.out, ranking, tokenizer=config.draft.name, vocab=len(tokenizer),
                  counted=sum(counts.values()), distinct=len(counts), sources=list(args.sources))
    top = sum(counts[t] for t in ranking[:4096]) / max(1, sum(counts.values()))
    log.info("%d tokens, %d distinct, from %d files; the top 4096 cover %.1f%%; wrote %s",
             sum(counts.values()), len(counts), len(files), 100 * top, args.out)
