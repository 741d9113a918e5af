"""HuggingFace transformers assisted generation (`generate(assistant_model=...)`),
run on our loaded target and draft and timed the way our engines are.

Like for like with our SD:
- the same modules (e.g. bf16 target, int8-quantized draft), the same prompt ids;
- the draft proposes exactly K tokens a round: `num_assistant_tokens=K` with
  the "constant" schedule, and the confidence threshold (which would end a
  draft early) off;
- the same sampling: greedy, or temperature / top-k / top-p as configured,
  with every other logits processor the model's generation_config could bring
  (repetition penalty, HF's default top_k=50) switched off; draws come from
  torch's global RNG, seeded per request (the caller's RNG state is restored);
- the same end conditions: max_new_tokens and the pair's EOS ids (stop
  strings are not passed: HF would stop after, not cut at, the string).

One deliberate difference from stock HF: the LM heads get a dense copy of
their input. HF picks the last n hidden states with an int `logits_to_keep`,
a sliced view whose size-1 batch dim keeps the full sequence's stride, and
torch's bf16 CPU matmul takes a slow kernel on such a view (measured here:
seconds per call for the 1.5B's head, ~0.1 s on a dense copy). Our
KVSequence avoids the same trap by passing an index tensor; without the copy
every HF round would pay it, and the bench would measure a kernel quirk,
not assisted generation. `dense_head_input=False` measures stock HF.

Measures: a streamer sees each round's admitted tokens (n accepted + 1) as
one `put`, and a forward pre-hook on the draft counts its steps, so rounds,
drafted and accepted tokens are exact. HF admits the first round's tokens
together: time to first token is the time to that first round, and the
decode rate counts the tokens and time after it (`GenerationResult.first_tokens`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from transformers import GenerationConfig as HFGenerationConfig
from transformers.generation.streamers import BaseStreamer

from ssd.config import GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine.metrics import GenerationStats, Stopwatch
from ssd.engine.request import GenerationRequest, GenerationResult
from ssd.models.quant import precision_of
from ssd.models.tokenizer import eos_token_ids

log = logging.getLogger(__name__)

# The draft's generation_config fields assisted generation reads its drafting policy from.
_ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


class _RoundStreamer(BaseStreamer):
    """Records (elapsed s, tokens admitted, draft steps) per assisted round.

    generate() puts the prompt first; every later put is one round.
    """

    def __init__(self, clock: Stopwatch, draft_steps: "_StepCounter") -> None:
        self.clock = clock
        self.draft_steps = draft_steps
        self.rounds: list[tuple[float, int, int]] = []
        self._prompt_seen = False
        self._steps_seen = 0

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        steps = self.draft_steps.count
        self.rounds.append((self.clock.elapsed(), int(value.numel()), steps - self._steps_seen))
        self._steps_seen = steps

    def end(self) -> None:
        pass


class _StepCounter:
    """Counts forward calls of a module (each drafting forward yields one draft token)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.count += 1


def _dense_input(module: torch.nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook: replace a strided (sliced) input by a dense copy; leave dense ones alone."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.stride() == _dense_strides(x.shape):
        return None
    return (x.new_empty(x.shape).copy_(x), *args[1:])


def _dense_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class HFAssistedEngine:
    """Our engine interface (generate / close / context manager) over HF assisted generation."""

    mode = "hf"

    def __init__(
        self, target: torch.nn.Module, draft: torch.nn.Module, tokenizer: Any, speculation: SpeculationConfig,
        dense_head_input: bool = True,
    ) -> None:
        """`speculation`: the settings (its K) for requests that bring none of their own."""
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.speculation = speculation
        self.dense_head_input = dense_head_input
        self.eos_ids = eos_token_ids(tokenizer, target)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """One assisted generation, sampled from torch's global RNG seeded with sampling.seed.

        K comes from the request's speculation settings (else the engine's);
        HF runs to the end, so token callbacks get the whole output at once.
        """
        sampling, generation = request.sampling, request.generation
        k = request.settings(self.speculation).k
        if generation.stop:
            log.warning("HF assisted generation ignores stop strings %s", generation.stop)
        config = hf_generation_config(sampling, generation, set() if generation.ignore_eos else self.eos_ids)
        input_ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.target.device)
        # HF draws from torch's global RNG: seed it per request, and leave the caller's state as it was.
        with torch.random.fork_rng(devices=[]), self._assistant_policy(k), self._counted_draft() as steps, \
                self._dense_heads(), torch.inference_mode():
            torch.manual_seed(sampling.seed)
            clock = Stopwatch()
            streamer = _RoundStreamer(clock, steps)
            out = self.target.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                assistant_model=self.draft, generation_config=config, streamer=streamer,
            )
            total_s = clock.elapsed()
        tokens = out[0, input_ids.shape[1]:].tolist()
        stats = self._stats(len(request.prompt_ids), k, tokens, streamer.rounds, total_s)
        finish = "eos" if tokens and tokens[-1] in config_eos(config) else "length"
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        first = streamer.rounds[0][1] if streamer.rounds else len(tokens)
        request.emit(tokens)
        return GenerationResult(tokens, text, finish, stats, first_tokens=first)

    def _stats(
        self, prompt_tokens: int, k: int, tokens: list[int], rounds: list[tuple[float, int, int]], total_s: float
    ) -> GenerationStats:
        """Our GenerationStats; the first round counts as the first token, as our prefill does."""
        stats = GenerationStats(mode=self.mode, k=k, prompt_tokens=prompt_tokens, new_tokens=len(tokens),
                                total_s=total_s, time_to_first_token_s=rounds[0][0] if rounds else total_s,
                                precision=f"target {precision_of(self.target)}, draft {precision_of(self.draft)}")
        for _, admitted, drafted in rounds[1:]:
            stats.record_round(drafted=drafted, accepted=min(admitted - 1, drafted))
        return stats

    @contextlib.contextmanager
    def _assistant_policy(self, k: int) -> Iterator[None]:
        """Draft exactly K tokens a round; restore the draft's own settings after."""
        gen_config = self.draft.generation_config
        saved = {name: getattr(gen_config, name, None) for name in _ASSISTANT_FIELDS}
        gen_config.num_assistant_tokens = k
        gen_config.num_assistant_tokens_schedule = "constant"
        gen_config.assistant_confidence_threshold = 0.0
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(gen_config, name, value)

    @contextlib.contextmanager
    def _counted_draft(self) -> Iterator[_StepCounter]:
        counter = _StepCounter()
        handle = self.draft.register_forward_pre_hook(counter)
        try:
            yield counter
        finally:
            handle.remove()

    @contextlib.contextmanager
    def _dense_heads(self) -> Iterator[None]:
        """While HF generates, hand both LM heads dense inputs (see the module docstring)."""
        heads = [m.get_output_embeddings() for m in (self.target, self.draft)] if self.dense_head_input else []
        handles = [head.register_forward_pre_hook(_dense_input) for head in heads if head is not None]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def close(self) -> None:
        """Nothing runs besides the caller's thread."""

    def __enter__(self) -> "HFAssistedEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hf_generation_config(
    sampling: SamplingConfig, generation: GenerationConfig, eos_ids: set[int]
) -> HFGenerationConfig:
    """A transformers GenerationConfig that samples exactly as our SamplingConfig does.

    Every processor is set explicitly: unset (None) fields would be filled
    from the model's generation_config and HF's defaults (top_k=50).
    """
    eos = sorted(eos_ids) or None
    warpers = (
        {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
        if not sampling.greedy else {}  # greedy: no warpers run, and HF warns about set ones
    )
    return HFGenerationConfig(
        max_new_tokens=generation.max_new_tokens,
        do_sample=not sampling.greedy,
        repetition_penalty=1.0,
        num_beams=1,
        eos_token_id=eos,
        # Never a token the prompt may hold: HF masks pad ids out of the
        # draft's attention (a pad id of 0 wrecked the tiny draft's proposals).
        pad_token_id=eos[0] if eos else None,
        **warpers,
    )


def config_eos(config: HFGenerationConfig) -> set[int]:
    eos = config.eos_token_id
    return set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
