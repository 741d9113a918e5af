"""The real model pair on the llama.cpp backend: loading, batch invariance, greedy exactness, speed.

    python launch/bench_llamacpp.py                       # everything, 1 thread, 48 tokens per prompt
    python launch/bench_llamacpp.py --skip-invariance --skip-exactness --out speed.txt

Target Qwen2.5-Coder-1.5B-Instruct, draft -0.5B-Instruct, both the official
q4_k_m GGUF files (ssd.models.offline.ensure_offline_gguf). Four parts:

1. load: each model as a LlamaCppModel with contexts of --n-ctx tokens per
   slot (not the 32k trained context); load time and resident memory.
2. invariance: the logits of 5 greedy tokens decoded one at a time, vs the
   same 5 in one forward (a K+1 verification), vs each decoded as one of 3
   rows in a packed forward; max |diff| and whether an argmax ever differs,
   for the default context options and for flash attention / F16 KV /
   the other weight layout (--other-layout: plain if the models loaded
   repacked, repacked if they loaded plain).
3. exactness: greedy AR vs SD (--sd-k) vs in-process SSD (--ssd-k, --budget)
   on the llama.cpp backend, token for token; where they part, the target's
   top-2 logit gap there.
4. speed, interleaved by prompt: llama-cpp-python's own `Llama.generate`
   (greedy), our AREngine, SDEngine and in-process SSDEngine; prefill
   (time to the first token) and decode tokens/s after it.

Prompts are plain code prefixes (no chat template); EOS is ignored, every
run makes exactly --tokens tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ssd.tools.bench.llamacpp import GGUFTokenizer, LlamaCppEngine

if TYPE_CHECKING:
    import torch

    from ssd.models.llamacpp import LlamaCppModel

PROMPTS = [
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list."""\n',
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "#include <stdio.h>\n\n/* Count the words in a line read from stdin. */\nint main(void) {\n",
]
# Part 2's context options: (label, LlamaCppContext options, in the other weight layout)
INVARIANCE_VARIANTS = [
    ("default (F32 KV, no flash attn, pad_single)", {}, False),
    ("flash attention on (F32 KV)", {"flash_attn": True}, False),
    ("F16 KV cache, no flash attn", {"kv_type": "f16"}, False),
    ("F16 KV + flash attn (llama.cpp's usual)", {"kv_type": "f16", "flash_attn": True}, False),
    ("BF16 KV + flash attn", {"kv_type": "bf16", "flash_attn": True}, False),
]
OTHER_LAYOUT = ("the other weight layout, default context", {}, True)

Say = Callable[..., None]  # prints a report line and keeps it for --out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads, every system")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    parser.add_argument("--n-ctx", type=int, default=512, help="tokens per sequence slot")
    parser.add_argument("--sd-k", type=int, default=4, help="SD's drafted tokens per round")
    parser.add_argument("--ssd-k", type=int, default=2, help="SSD's drafted tokens per round")
    parser.add_argument("--budget", type=int, default=4, help="SSD's fan-out budget")
    parser.add_argument("--other-layout", action="store_true",
                        help="also measure invariance in the weight layout the models did not load in (plain "
                             "or llama.cpp's repacked one); where repacked kernels fail, llama.cpp may die (SIGILL)")
    parser.add_argument("--skip-invariance", action="store_true")
    parser.add_argument("--skip-exactness", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--out", type=Path, help="also write the report here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import llama_cpp
    import torch

    from ssd.models.offline import DRAFT_NAME, TARGET_NAME, ensure_offline_gguf

    torch.set_num_threads(args.threads)  # our llama.cpp contexts take torch's thread count
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"# bench_llamacpp {' '.join(sys.argv[1:] if argv is None else argv)}")
    say(hardware_line())
    say(f"llama-cpp-python {llama_cpp.__version__}; threads {args.threads}; {args.tokens} new tokens per prompt; "
        f"n_ctx {args.n_ctx} per slot")
    paths = {name: str(ensure_offline_gguf(name)) for name in (TARGET_NAME, DRAFT_NAME)}
    models = load_models({"target": (TARGET_NAME, paths[TARGET_NAME]), "draft": (DRAFT_NAME, paths[DRAFT_NAME])},
                         args, say)
    tok = GGUFTokenizer(models["target"])
    prompts = [tok.encode(p) for p in PROMPTS]
    say(f"prompts: {[len(p) for p in prompts]} tokens")
    if not args.skip_invariance:
        report_invariance(models, prompts, args, say)
    if not args.skip_exactness:
        report_exactness(models, tok, prompts, args, say)
    if not args.skip_speed:
        report_speed(Path(paths[TARGET_NAME]), models, tok, prompts, args, say)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def hardware_line() -> str:
    import torch

    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    cpu = cpu.split(":", 1)[-1].strip() or platform.processor()
    load = os.getloadavg()
    return (f"CPU {cpu}; {os.cpu_count()} cores; torch CPU capability {torch.backends.cpu.get_cpu_capability()}; "
            f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


# --- 1. load -------------------------------------------------------------------------------------


def load_models(files: dict[str, tuple[str, str]], args: argparse.Namespace, say: Say) -> dict[str, LlamaCppModel]:
    """Each role's model with its load time and the resident memory it and a 1-slot context add."""
    from ssd.models.llamacpp import LlamaCppContext, LlamaCppModel

    say("\n## 1. load (LlamaCppModel: repacked layouts where they run; RSS of this process)")
    models = {}
    for role, (name, path) in files.items():
        r0, t0 = rss_mb(), time.perf_counter()
        m = LlamaCppModel(path, n_ctx=args.n_ctx)
        t1 = time.perf_counter()
        r1 = rss_mb()
        c = LlamaCppContext(m, n_seq=1, n_threads=args.threads)
        r2 = rss_mb()
        c.close()
        say(f"{role} {name}: {m.description}{', repacked' if m.repacked else ''}; "
            f"file {os.path.getsize(path) / 2**20:.0f} MiB; load {t1 - t0:.2f} s; RSS +{r1 - r0:.0f} MiB (model, mmap'd pages touched so far), "
            f"+{r2 - r1:.0f} MiB for a 1-slot context of {m.n_ctx} tokens "
            f"(KV {m.kv_bytes_per_token() * m.n_ctx / 2**20:.1f} MiB); vocab {m.vocab_size}, "
            f"trained context {m.n_ctx_train}")
        models[role] = m
    return models


# --- 2. invariance -------------------------------------------------------------------------------


def report_invariance(models: dict[str, LlamaCppModel], prompts: list[list[int]], args: argparse.Namespace,
                      say: Say) -> None:
    """Part 2 for each role and context variant (and the other weight layout with --other-layout)."""
    from ssd.models.llamacpp import LlamaCppModel

    say("\n## 2. batch invariance: 5 greedy tokens alone vs in one 5-token forward vs as 1 of 3 packed rows")
    say("(max |logit diff| over 5 rows x vocab; 'argmax differs' if a greedy token would change)")
    variants = INVARIANCE_VARIANTS + ([OTHER_LAYOUT] if args.other_layout else [])
    for role in ("target", "draft"):
        base = models[role]
        extra = None
        for label, options, use_extra in variants:
            m = base
            if use_extra:
                extra = extra or LlamaCppModel(base.path, use_extra_bufts=not base.repacked, n_ctx=args.n_ctx)
                m = extra
            r = invariance(m, prompts[0], prompts[1:], args.threads, **options)
            say(f"{role:6s} {label:60s} verify {r['verify'][0]:.3g}{' ARGMAX DIFFERS' if r['verify'][1] else ''}"
                f" | packed {r['packed'][0]:.3g}{' ARGMAX DIFFERS' if r['packed'][1] else ''}")
        if extra is not None:
            extra.close()


def invariance(model: LlamaCppModel, prompt_ids: list[int], others: list[list[int]], threads: int,
               **options: Any) -> dict[str, tuple[float, bool]]:
    """Logits of 5 greedy tokens: alone vs one 5-token forward vs rows of a 3-row packed forward."""
    alone, toks = _alone(model, prompt_ids, threads, options)
    verify = _verified(model, prompt_ids, toks, threads, options)
    packed = _packed(model, prompt_ids, others, toks, threads, options)

    def cmp(a: torch.Tensor, b: torch.Tensor) -> tuple[float, bool]:
        return float((a - b).abs().max()), bool((a.argmax(-1) != b.argmax(-1)).any())

    return {"verify": cmp(alone, verify), "packed": cmp(alone, packed)}


def _context(model: LlamaCppModel, n: int, threads: int, options: dict[str, Any]) -> Any:
    from ssd.models.llamacpp import LlamaCppContext

    return LlamaCppContext(model, n_seq=n, n_ctx_seq=model.n_ctx, n_threads=threads, **options)


def _alone(model: LlamaCppModel, prompt_ids: list[int], threads: int,
           options: dict[str, Any]) -> tuple[torch.Tensor, list[int]]:
    """Five greedy tokens, one token per forward: their logits and the tokens."""
    import torch

    from ssd.models.llamacpp import LlamaCppSequence

    c = _context(model, 1, threads, options)
    s = LlamaCppSequence(c)
    row = s.forward(prompt_ids, last_only=True)[-1]
    alone, toks = [], []
    for _ in range(5):
        t = int(row.argmax())
        toks.append(t)
        row = s.forward([t])[0]
        alone.append(row)
    c.close()
    return torch.stack(alone), toks


def _verified(model: LlamaCppModel, prompt_ids: list[int], toks: list[int], threads: int,
              options: dict[str, Any]) -> torch.Tensor:
    """The same tokens after the prompt in one K+1 forward: rows 0..4 predict after toks[0..4]."""
    from ssd.models.llamacpp import LlamaCppSequence

    c = _context(model, 1, threads, options)
    s = LlamaCppSequence(c)
    s.forward(prompt_ids, last_only=True)
    verify = s.forward(toks)
    c.close()
    return verify


def _packed(model: LlamaCppModel, prompt_ids: list[int], others: list[list[int]], toks: list[int], threads: int,
            options: dict[str, Any]) -> torch.Tensor:
    """Each step one token of three rows in one llama_decode; the first row's logits."""
    import torch

    from ssd.models.llamacpp import LlamaCppSequence, forward_rows

    c = _context(model, 3, threads, options)
    rows = [LlamaCppSequence(c) for _ in range(3)]
    for r, p in zip(rows, [prompt_ids, *others]):
        r.forward(p, last_only=True)
    packed, other_next = [], [0, 0]
    for t in toks:
        out = forward_rows(rows, [[t], [other_next[0]], [other_next[1]]])
        packed.append(out[0][0])
        other_next = [int(out[1][0].argmax()), int(out[2][0].argmax())]
    c.close()
    return torch.stack(packed)


# --- 3. exactness --------------------------------------------------------------------------------


def report_exactness(models: dict[str, LlamaCppModel], tok: GGUFTokenizer, prompts: list[list[int]],
                     args: argparse.Namespace, say: Say) -> None:
    """Part 3: SD's and SSD's greedy tokens against AR's, per prompt; where they part, the gap there."""
    target, draft = models["target"], models["draft"]
    say(f"\n## 3. greedy exactness: AR vs SD (K={args.sd_k}) vs SSD in process (K={args.ssd_k}, "
        f"budget {args.budget}), {args.tokens} tokens")
    for i, p in enumerate(prompts):
        ar = run_engine("ar", target, draft, tok, p, args)[0]
        for kind in ("sd", "ssd"):
            got, _, _, st = run_engine(kind, target, draft, tok, p, args)
            extra = (f"accepted {st.accepted}/{st.drafted}" if kind == "sd"
                     else f"hits {st.spec.hits}/{st.spec.lookups}")
            if got == ar:
                say(f"prompt {i}: {kind} == ar ({len(ar)} tokens; {extra})")
            else:
                j = next((j for j in range(min(len(got), len(ar))) if got[j] != ar[j]), min(len(got), len(ar)))
                gap = top2_gap(target, p + ar[:j], args.threads)
                say(f"prompt {i}: {kind} PARTS from ar at token {j} ({got[j:j + 3]} vs {ar[j:j + 3]}); "
                    f"target top-2 gap there {gap[0]:.4g} ({gap[1]} vs {gap[2]}); {extra}")
        say(f"  ar text: {tok.decode(ar)!r}")


def top2_gap(model: LlamaCppModel, ids: list[int], threads: int) -> tuple[float, int, int]:
    """Target's top-2 logit gap after `ids` (fresh sequence, default options)."""
    from ssd.models.llamacpp import LlamaCppSequence

    s = LlamaCppSequence(model, n_threads=threads)
    row = s.forward(ids, last_only=True)[-1]
    s.close()
    top = row.topk(2)
    return float(top.values[0] - top.values[1]), int(top.indices[0]), int(top.indices[1])


# --- 3./4. the systems ---------------------------------------------------------------------------


def run_engine(kind: str, target: LlamaCppModel, draft: LlamaCppModel, tok: GGUFTokenizer, prompt_ids: list[int],
               args: argparse.Namespace) -> tuple[list[int], float, float, Any]:
    """(token ids, prefill s, decode s, stats) of one greedy generation on our engines."""
    from ssd.config import BatchingConfig, FanoutConfig, GenerationConfig, SamplingConfig, SpeculationConfig
    from ssd.engine import AREngine, SDEngine
    from ssd.engine.request import GenerationRequest
    from ssd.saguaro.target import SSDEngine

    batching = BatchingConfig(max_rows=1, max_batched_tokens=args.n_ctx, prefill_chunk=args.n_ctx,
                              kv_memory_mb=args.n_ctx * target.kv_bytes_per_token() / 2**20)
    spec = None
    if kind == "ar":
        engine = AREngine(target, tok, batching=batching)
    elif kind == "sd":
        spec = SpeculationConfig(mode="sd", k=args.sd_k)
        # SD keeps both models' caches: the KV budget holds a slot of each
        kv_mb = args.n_ctx * (target.kv_bytes_per_token() + draft.kv_bytes_per_token()) / 2**20
        engine = SDEngine(target, draft, tok, spec, batching=dataclasses.replace(batching, kv_memory_mb=kv_mb))
    else:
        spec = SpeculationConfig(mode="ssd", k=args.ssd_k, fanout=FanoutConfig(budget=args.budget))
        engine = SSDEngine.in_process(target, draft, tok, spec, batching=batching)
    try:
        req = GenerationRequest(list(prompt_ids), SamplingConfig(temperature=0.0),
                                GenerationConfig(max_new_tokens=args.tokens), spec)
        res = engine.generate(req)
    finally:
        if hasattr(engine, "close"):
            engine.close()
    st = res.stats
    return res.token_ids, st.time_to_first_token_s, st.total_s - st.time_to_first_token_s, st


def run_plain(peer: LlamaCppEngine, prompt_ids: list[int], n: int) -> tuple[list[int], float, float]:
    """llama.cpp's own greedy loop (ssd.tools.bench.llamacpp.LlamaCppEngine): (ids, prefill s, decode s)."""
    from ssd.config import GenerationConfig, SamplingConfig
    from ssd.engine.request import GenerationRequest

    request = GenerationRequest(list(prompt_ids), SamplingConfig(temperature=0.0),
                                GenerationConfig(max_new_tokens=n, ignore_eos=True))
    result = peer.generate(request)
    ttft = result.stats.time_to_first_token_s
    return result.token_ids, ttft, result.stats.total_s - ttft


# --- 4. speed ------------------------------------------------------------------------------------


SYSTEMS = ["plain", "ar", "sd", "ssd"]


def report_speed(gguf: Path, models: dict[str, LlamaCppModel], tok: GGUFTokenizer, prompts: list[list[int]],
                 args: argparse.Namespace, say: Say) -> None:
    """Part 4: every system on every prompt, interleaved by prompt, then the totals."""
    say(f"\n## 4. speed, {args.threads} thread(s), interleaved by prompt; load average now "
        f"{os.getloadavg()[0]:.2f}")
    llms = LlamaCppEngine(gguf, threads=args.threads, n_ctx=args.n_ctx)
    say("plain: llama.cpp's context defaults (flash attention auto, F16 KV), its greedy sampler, "
        "one llama_decode per token (ssd.tools.bench.llamacpp)")
    totals = {s: [0.0, 0.0, 0, 0] for s in SYSTEMS}  # prefill s, decode s, prompt tokens, decode tokens
    plain_ids: dict[int, list[int]] = {}
    run_plain(llms, prompts[0], 4)  # warm-up: one short run (pages in the weights)
    for i, p in enumerate(prompts):
        for s in SYSTEMS:
            ids, pre, dec, note = _timed(s, llms, models, tok, p, args, plain_ids.get(i))
            if s == "plain":  # runs first: AR's tokens are compared with these
                plain_ids[i] = ids
            t = totals[s]
            t[0] += pre
            t[1] += dec
            t[2] += len(p)
            t[3] += len(ids) - 1
            say(f"prompt {i} {s:5s}: prefill {len(p)} tok {pre * 1000:7.1f} ms; decode {len(ids) - 1} tok "
                f"{dec:6.3f} s = {(len(ids) - 1) / dec:6.2f} tok/s{note}")
    say("totals:")
    for s in SYSTEMS:
        pre, dec, np_, nd = totals[s]
        say(f"  {s:5s}: prefill {np_ / pre:7.1f} tok/s; decode {nd / dec:6.2f} tok/s "
            f"({nd / dec / (totals['plain'][3] / totals['plain'][1]):.3f}x plain)")
    say(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _timed(system: str, llms: LlamaCppEngine, models: dict[str, LlamaCppModel], tok: GGUFTokenizer,
           prompt: list[int], args: argparse.Namespace,
           plain_ids: Sequence[int] | None) -> tuple[list[int], float, float, str]:
    """One system's run: (ids, prefill s, decode s, the row's note)."""
    if system == "plain":
        ids, pre, dec = run_plain(llms, prompt, args.tokens)
        return ids, pre, dec, ""
    ids, pre, dec, st = run_engine(system, models["target"], models["draft"], tok, prompt, args)
    if system == "ar":
        note = " tokens == plain" if ids == plain_ids else " tokens != plain"
    else:
        note = f" accepted {st.accepted}/{st.drafted}" if system == "sd" else f" hits {st.spec.hits}/{st.spec.lookups}"
    return ids, pre, dec, note
