"""A draft's LM head over a frequency-ranked subset of the vocabulary (FR-Spec).

FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language
Models via Frequency-Ranked Speculative Sampling"): most of a draft step's
LM head computes logits for tokens the draft almost never proposes. The
draft's head keeps only the rows of the `size` most frequent tokens (a
ranking measured on text, `launch/vocab_rank.py`), so a step reads
size / V of the head's weights (Qwen2.5's head: 136M of the 0.5B's 630M
parameters, 151,936 rows).

Exactness: the restricted head still returns logits over the whole
vocabulary, FILL outside the subset, so everything downstream (the one
sampling pipeline, the q rows the draft ships, verification) is unchanged:
q is the distribution the token was drawn from, zero outside the subset
(exp(FILL - max) underflows to 0 in float64), and the ratio test and the
residual max(0, p - q) use that q (Leviathan et al. 2023): the output law is
the target's whatever q is. FILL is finite, not -inf: where a request's
logits processing (a grammar) forbids every subset token, the row is
uniform over the allowed tokens outside it instead of having no mass (still
the law the token is drawn from, so still exact).

The subset's logits are the full head's at those rows: bit for bit in
int8 (weights quantized per output channel, activations per row); in fp32
up to the summation order of the GEMM kernel, which may change with the row
count (a few ulp on an AMD EPYC AVX512 host). Exactness does not rest on it:
q is whatever the subset head gives.

Torch models only (nn.Linear, int8 and GGUF-kernel heads; a GGUF-kernel head's
subset is its own blocks for those rows, so bit for bit): llama.cpp computes its full `output` tensor inside
llama_decode, and a GGUF with a shrunk output tensor would need n_vocab (and
the tokenizer the file carries) to change with it; see docs/llamacpp.md.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ssd.config import ConfigError, DraftVocabConfig
from ssd.models.quant import Int8Linear

log = logging.getLogger(__name__)

FILL = -1e30  # logit outside the subset: finite (see the module docstring), exp(FILL - max) == 0


class SubsetHead(nn.Module):
    """An LM head computing only the rows `ids`; logits [..., vocab] with FILL elsewhere."""

    def __init__(self, head: nn.Module, ids: torch.Tensor, vocab: int) -> None:
        super().__init__()
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel():
            raise ValueError(f"a vocabulary subset needs distinct ids in 0..{vocab - 1}, got {ids.numel()} ids")
        self.rows = _head_rows(head, ids)
        self.vocab = vocab
        self.register_buffer("ids", ids.to(_device_of(head)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sub = self.rows(x)
        out = sub.new_full((*sub.shape[:-1], self.vocab), FILL)
        return out.index_copy_(-1, self.ids, sub)

    def extra_repr(self) -> str:
        return f"subset={self.ids.numel()} of vocab={self.vocab}"


def _device_of(head: nn.Module) -> torch.device:
    tensor = next(iter(head.parameters()), None)
    if tensor is None:
        tensor = next(iter(head.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _head_rows(head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A head of the same kind computing only output rows `ids` (their own copies of the weights)."""
    if isinstance(head, Int8Linear):
        ints, scales = head.int8_weight()
        bias = None if head.bias is None else head.bias[ids].clone()
        rows = Int8Linear.from_int8(ints[ids].clone(), scales[ids].clone(), bias)
        rows.pack()
        return rows
    if type(head) is nn.Linear:
        weight = head.weight.detach()
        rows = nn.Linear(head.in_features, ids.numel(), bias=head.bias is not None,
                         device=weight.device, dtype=weight.dtype)
        rows.weight = nn.Parameter(weight[ids.to(weight.device)].clone(), requires_grad=False)
        if head.bias is not None:
            rows.bias = nn.Parameter(head.bias.detach()[ids.to(weight.device)].clone(), requires_grad=False)
        return rows
    # A GGUF-kernel head (its module is loaded only where such a model is: it needs the gguf package).
    kernels = sys.modules.get("ssd.models.kernels.qlinear")
    if kernels is not None and isinstance(head, kernels.QLinear):
        return head.rows(ids)
    raise NotImplementedError(f"a vocabulary subset needs an nn.Linear, Int8Linear or QLinear head, "
                              f"not {type(head).__name__}")


def restrict_head(model: nn.Module, ids: Sequence[int] | torch.Tensor) -> nn.Module:
    """Give `model` (a torch causal LM) a SubsetHead over `ids`, in place; returns it."""
    head = model.lm_head
    if isinstance(head, SubsetHead):
        raise ValueError("the model's head is already restricted to a subset")
    vocab = model.config.vocab_size
    model.lm_head = SubsetHead(head, torch.as_tensor(list(ids) if not torch.is_tensor(ids) else ids), vocab)
    return model


def subset_of(model: nn.Module) -> torch.Tensor | None:
    """The ids a restricted head computes (None: the full vocabulary)."""
    head = getattr(model, "lm_head", None)
    return head.ids if isinstance(head, SubsetHead) else None


# --- The ranking file ------------------------------------------------------------------
#
# JSON: {"tokenizer": name, "vocab": V, "counted": tokens counted, "sources":
# [paths], "ranking": [ids, most frequent first; only ids seen]}. Written by
# launch/vocab_rank.py (ssd.tools.ablation.vocab).


def write_ranking(path: Path, ranking: Sequence[int], **meta: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "ranking": list(map(int, ranking))}) + "\n")


REPOSITORY = Path(__file__).resolve().parents[2]


def ranking_path(path: Path | str) -> Path:
    """`path` as given, or under the repository root when relative and absent
    here (configs/vocab/... from any working directory)."""
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists():
        return given
    return REPOSITORY / given


def read_ranking(path: Path | str) -> list[int]:
    try:
        data = json.loads(ranking_path(path).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"speculation.draft_vocab.source: cannot read a token ranking from {path}: {error}") from error
    ranking = data.get("ranking") if isinstance(data, dict) else None
    if not isinstance(ranking, list) or not all(isinstance(t, int) for t in ranking):
        raise ConfigError(f"speculation.draft_vocab.source: {path} has no 'ranking' list of token ids")
    return ranking


def subset_ids(ranking: Sequence[int], size: int, vocab: int, always: Sequence[int] = ()) -> list[int]:
    """The `size` ids a draft keeps: `always` (the EOS ids) first, then the ranking's
    order, then (if the ranking saw fewer tokens) the lowest ids not yet in; sorted."""
    if not 0 < size <= vocab:
        raise ConfigError(f"speculation.draft_vocab.size must be in 1..{vocab} (the vocabulary), got {size}")
    chosen: dict[int, None] = {}
    for token in (*always, *ranking, *range(vocab)):
        if len(chosen) == size:
            break
        if 0 <= token < vocab:
            chosen.setdefault(int(token), None)
    return sorted(chosen)


def apply_draft_vocab(model: Any, cfg: DraftVocabConfig, eos_ids: Sequence[int] = ()) -> Any:
    """The draft `model` with its head restricted as `cfg` says (size 0: as it is)."""
    if not cfg.size:
        return model
    if not isinstance(model, nn.Module):  # a config may name both backends (backend: auto)
        log.warning("speculation.draft_vocab is ignored on a llama.cpp draft: llama.cpp computes the full "
                    "output head inside llama_decode (draft.backend: torch uses the subset)")
        return model
    vocab = model.config.vocab_size
    if cfg.size >= vocab:
        return model
    ids = subset_ids(read_ranking(cfg.source), cfg.size, vocab, eos_ids)
    log.info("draft head: %d of %d vocabulary rows (%s)", len(ids), vocab, cfg.source)
    return restrict_head(model, ids)


def model_eos_ids(model: Any) -> list[int]:
    """The EOS ids a model's config names (kept in every subset: a draft that can end a text)."""
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
