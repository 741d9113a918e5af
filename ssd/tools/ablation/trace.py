"""Traces: what the target and the draft predicted along target trajectories.

A trace is recorded once with the models and replayed many times without
them (ssd.tools.ablation.replay). For each prompt the target generates a trajectory
(the AR engine: greedy at T = 0, seeded sampling at T > 0); then one
teacher-forced forward of each model over prompt + trajectory gives its
logits at every generated position. Per position we keep what replay needs:

- each model's top-N logits (values, indices), N = `top_n`; with N >= V the
  whole row is kept, so a small model's trace is exact;
- the logit each model gives the trajectory token, and each model's
  log-sum-exp of logits / T (T = 1 under greedy), so probabilities of the
  kept tokens are exact even when the row is cut;
- the target's logits at the draft's top-N tokens (the rejection residual
  max(0, q' - p) lives on the draft's likely tokens).

Files are safetensors (tensors) with the metadata as one JSON string: no
pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ssd.config import GenerationConfig, SamplingConfig
from ssd.engine.ar import AREngine
from ssd.engine.request import GenerationRequest
from ssd.hardware import to_host
from ssd.models.kv import KVSequence

log = logging.getLogger(__name__)

FORMAT = "ssd-ablation-trace/1"
DEFAULT_TOP_N = 128
POSITION_FIELDS = (
    "target_top_values", "target_top_indices", "draft_top_values", "draft_top_indices",
    "target_at_draft_top", "target_token_logit", "draft_token_logit", "target_lse", "draft_lse",
)


@dataclass
class TraceMeta:
    """Everything needed to interpret (and reproduce) a trace."""

    target: dict[str, Any]  # name, dtype, quantization
    draft: dict[str, Any]
    temperature: float
    seed: int
    top_n: int  # logits kept per position and model (min(N, V))
    vocab_size: int
    eos_ids: list[int]  # the ids that ended generation; [] when EOS was ignored
    max_new_tokens: int
    prompt_source: str | None = None
    chunk: int = 0  # tokens per scoring forward when recorded (0: one forward)
    format: str = FORMAT

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Positions:
    """Per generated position of one sequence: row i predicts trajectory token i."""

    target_top_values: torch.Tensor  # [n, N] float32 (float64 for fp64 models), descending
    target_top_indices: torch.Tensor  # [n, N] int32
    draft_top_values: torch.Tensor  # [n, N] like target_top_values
    draft_top_indices: torch.Tensor  # [n, N] int32
    target_at_draft_top: torch.Tensor  # [n, N]: target logits at draft_top_indices
    target_token_logit: torch.Tensor  # [n] float64: target logit of the trajectory token
    draft_token_logit: torch.Tensor  # [n] float64
    target_lse: torch.Tensor  # [n] float64: logsumexp(logits / T) (T = 1 when greedy)
    draft_lse: torch.Tensor  # [n] float64

    def __len__(self) -> int:
        return int(self.target_token_logit.shape[0])


@dataclass
class TraceSequence:
    """One trajectory: which prompt, which seed, the generated ids and why it ended."""

    prompt_index: int
    seed: int
    tokens: list[int]
    finish_reason: str
    positions: Positions = field(repr=False)


@dataclass
class Trace:
    meta: TraceMeta
    prompts: list[list[int]]  # token ids of each prompt
    sequences: list[TraceSequence]

    @property
    def num_positions(self) -> int:
        return sum(len(s.tokens) for s in self.sequences)


def positions_from_logits(
    target_logits: torch.Tensor, draft_logits: torch.Tensor, tokens: Sequence[int],
    top_n: int, temperature: float,
) -> Positions:
    """The stored view of two [n, V] logit rows along `tokens` (pure; tests build synthetic traces with it)."""
    if target_logits.shape != draft_logits.shape or target_logits.shape[0] != len(tokens):
        raise ValueError(
            f"logits must both be [len(tokens), V]: got {tuple(target_logits.shape)}, "
            f"{tuple(draft_logits.shape)} for {len(tokens)} tokens"
        )
    t, d = target_logits.to(torch.float64), draft_logits.to(torch.float64)
    # fp64 models keep fp64 values: rounding to fp32 could create ties the model never had.
    vtype = torch.float64 if target_logits.dtype == torch.float64 else torch.float32
    n = min(top_n, t.shape[-1])
    ids = torch.tensor(list(tokens), dtype=torch.long).unsqueeze(1)
    t_top, d_top = torch.topk(t, n, dim=-1), torch.topk(d, n, dim=-1)
    scale = temperature if temperature > 0 else 1.0
    return Positions(
        target_top_values=t_top.values.to(vtype), target_top_indices=t_top.indices.int(),
        draft_top_values=d_top.values.to(vtype), draft_top_indices=d_top.indices.int(),
        target_at_draft_top=t.gather(1, d_top.indices).to(vtype),
        target_token_logit=t.gather(1, ids)[:, 0], draft_token_logit=d.gather(1, ids)[:, 0],
        target_lse=torch.logsumexp(t / scale, dim=-1), draft_lse=torch.logsumexp(d / scale, dim=-1),
    )


def teacher_forced_logits(
    model: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int], chunk: int = 0,
) -> torch.Tensor:
    """[len(tokens), V]: the model's logits predicting each generated token.

    chunk 0: one forward over prompt + trajectory. chunk c > 0: the prompt
    (less its last token) in one call, as the speculator prefills, then c
    tokens per call. Mathematically the same; numerically not, and for a
    dynamically int8-quantized model (activation scales per call) the call
    shapes change the logits enough to matter: live SSD feeds the draft 1 to
    K + 1 tokens per call.
    """
    if chunk < 0:
        raise ValueError(f"chunk must be >= 0, got {chunk}")
    sequence = list(prompt) + list(tokens[:-1])
    kv = KVSequence(model)
    if chunk == 0:
        return to_host(kv.forward(sequence)[len(prompt) - 1 :])  # traces are stored from the host
    if len(prompt) > 1:
        kv.forward(sequence[: len(prompt) - 1], last_only=True)
    rest = sequence[len(prompt) - 1 :]
    return to_host(torch.cat([kv.forward(rest[i : i + chunk]) for i in range(0, len(rest), chunk)]))


@dataclass
class RecordSettings:
    sampling: SamplingConfig
    generation: GenerationConfig
    top_n: int = DEFAULT_TOP_N
    samples_per_prompt: int = 1  # trajectories per prompt (seeds seed, seed+1, ...); useful at T > 0
    chunk: int = 0  # tokens per scoring forward (0: one forward); see teacher_forced_logits


def record_trace(
    target: torch.nn.Module, draft: torch.nn.Module, tokenizer: Any, prompts: list[list[int]],
    settings: RecordSettings, model_info: dict[str, dict[str, Any]] | None = None,
    prompt_source: str | None = None, progress: Callable[[], None] | None = None,
) -> Trace:
    """Generate a trajectory per prompt (and sample) with the target, then score it with both models.

    model_info: {"target": {...}, "draft": {...}} for the metadata (name, dtype, quantization).
    progress: called once per finished trajectory.
    """
    _check_settings(settings, prompts)
    engine = AREngine(target, tokenizer)
    sequences = []
    for i, prompt in enumerate(prompts):
        for s in range(settings.samples_per_prompt):
            seed = settings.sampling.seed + i * settings.samples_per_prompt + s
            sequences.append(_record_one(engine, target, draft, i, prompt, seed, settings))
            if progress is not None:
                progress()
    info = model_info or {}
    meta = TraceMeta(
        target=info.get("target", {}), draft=info.get("draft", {}),
        temperature=settings.sampling.temperature, seed=settings.sampling.seed,
        top_n=min(settings.top_n, target.config.vocab_size), vocab_size=target.config.vocab_size,
        eos_ids=[] if settings.generation.ignore_eos else sorted(engine.eos_ids),
        max_new_tokens=settings.generation.max_new_tokens,
        prompt_source=prompt_source, chunk=settings.chunk,
    )
    return Trace(meta, [list(p) for p in prompts], sequences)


def _check_settings(settings: RecordSettings, prompts: list[list[int]]) -> None:
    if not prompts or any(not p for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    if settings.top_n < 1:
        raise ValueError(f"top_n must be >= 1, got {settings.top_n}")
    if settings.chunk < 0:
        raise ValueError(f"chunk must be >= 0, got {settings.chunk}")
    if settings.samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {settings.samples_per_prompt}")
    if settings.generation.stop:
        raise ValueError(
            "traces cannot use stop strings: they end a trajectory by its text, which a replay "
            "does not see; record without them (EOS and max_new_tokens are kept)"
        )
    s = settings.sampling
    if s.top_k or s.top_p < 1.0:
        raise ValueError(
            f"traces support temperature only: top_k={s.top_k}, top_p={s.top_p} would make the "
            "stored top-N rows disagree with the distributions the engine samples from"
        )


def _record_one(
    engine: AREngine, target: torch.nn.Module, draft: torch.nn.Module, index: int,
    prompt: list[int], seed: int, settings: RecordSettings,
) -> TraceSequence:
    sampling = dataclasses.replace(settings.sampling, seed=seed)
    result = engine.generate(GenerationRequest(prompt, sampling, settings.generation))
    tokens = result.token_ids
    positions = positions_from_logits(
        teacher_forced_logits(target, prompt, tokens, settings.chunk),
        teacher_forced_logits(draft, prompt, tokens, settings.chunk),
        tokens, settings.top_n, sampling.temperature,
    )
    log.debug("prompt %d seed %d: %d tokens (%s)", index, seed, len(tokens), result.finish_reason)
    return TraceSequence(index, seed, tokens, result.finish_reason, positions)


# ---------------------------------------------------------------------------
# Files


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write `trace` as safetensors; per-sequence rows are concatenated in order."""
    path = Path(path)
    tensors = {
        name: torch.cat([getattr(s.positions, name) for s in trace.sequences]).contiguous()
        for name in POSITION_FIELDS
    }
    tensors["tokens"] = torch.tensor([t for s in trace.sequences for t in s.tokens], dtype=torch.int64)
    tensors["prompt_ids"] = torch.tensor([t for p in trace.prompts for t in p], dtype=torch.int64)
    header = {
        "meta": asdict(trace.meta),
        "prompt_lengths": [len(p) for p in trace.prompts],
        "sequences": [
            {"prompt_index": s.prompt_index, "seed": s.seed, "length": len(s.tokens), "finish_reason": s.finish_reason}
            for s in trace.sequences
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"ssd_trace": json.dumps(header)})
    return path


def load_trace(path: str | Path) -> Trace:
    """Read a file written by `save_trace`; a file of another kind is refused by name."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get("ssd_trace")
        if raw is None:
            raise ValueError(f"{path} is not an ssd ablation trace (no 'ssd_trace' metadata)")
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    header = json.loads(raw)
    meta = TraceMeta(**header["meta"])
    if meta.format != FORMAT:
        raise ValueError(f"{path}: trace format {meta.format!r}, this code reads {FORMAT!r}")
    prompts = _split(tensors["prompt_ids"].tolist(), header["prompt_lengths"])
    lengths = [s["length"] for s in header["sequences"]]
    tokens = _split(tensors["tokens"].tolist(), lengths)
    chunks = {name: torch.split(tensors[name], lengths) for name in POSITION_FIELDS}
    sequences = [
        TraceSequence(s["prompt_index"], s["seed"], tokens[i], s["finish_reason"],
                  Positions(**{name: chunks[name][i] for name in POSITION_FIELDS}))
        for i, s in enumerate(header["sequences"])
    ]
    return Trace(meta, prompts, sequences)


def _split(flat: list[int], lengths: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in lengths:
        out.append(flat[start : start + n])
        start += n
    return out
