"""A LayerSkip-style draft: a view of the target's first L layers, and its acceptance dial.

The view is a second Qwen2ForCausalLM whose embedding, first L decoder
layers, final norm and LM head ARE the target's modules (no weight is
copied: a 32B target leaves no room for a second model); only the module
object is new, so it gets its own KV caches and its own CUDA graph pool
(ssd.models.graphs keys pools by module). Its cost is about L / N of a
target step plus the LM head: the paper's draft-to-target cost ratio
(a 0.5B draft verifying for a 32B target) at L of a few layers.

Its acceptance is set on the target side: the deeper layers' output
projections (attention o_proj and MLP down_proj, layers L..N-1) are scaled
by `s`. At s = 0 those layers add nothing to the residual stream and the
target's logits are the view's (acceptance 1); as s grows the target parts
from its view. `calibrate` searches s for a wanted acceptance with a few
short SD runs (greedy), since the law from s to acceptance is the random
model's and has no closed form.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

log = logging.getLogger(__name__)


def layer_view(target: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A model computing the target's first `layers` layers, then its final norm and LM head."""
    from transformers import Qwen2ForCausalLM

    total = target.config.num_hidden_layers
    if not 1 <= layers < total:
        raise ValueError(f"a view needs 1 <= layers < {total} (the target's layers), got {layers}")
    fields = {**target.config.to_dict(), "num_hidden_layers": layers}
    if fields.get("layer_types"):  # transformers 5 keeps one entry per layer
        fields["layer_types"] = fields["layer_types"][:layers]
    config = type(target.config).from_dict(fields)
    config._attn_implementation = target.config._attn_implementation
    with torch.device("meta"):  # every piece below is replaced by the target's own
        view = Qwen2ForCausalLM(config)
    view.model.embed_tokens = target.model.embed_tokens
    view.model.layers = torch.nn.ModuleList(target.model.layers[:layers])
    view.model.norm = target.model.norm
    view.model.rotary_emb = target.model.rotary_emb
    view.lm_head = target.lm_head
    left = [name for name, t in [*view.named_parameters(), *view.named_buffers()] if t.is_meta]
    if left:  # a transformers version with a piece this does not share: refuse rather than run on nothing
        raise RuntimeError(f"the layer view kept pieces of its own (on the meta device): {left}")
    view.eval()
    view.requires_grad_(False)
    return view


class DeepScale:
    """The dial: the factor on the output projections of the target's layers past the view."""

    def __init__(self, target: torch.nn.Module, first: int) -> None:
        self.weights = [w for layer in target.model.layers[first:]
                        for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]
        self.scale = 1.0

    @torch.no_grad()
    def set(self, scale: float) -> None:
        """Scale the deep projections to `scale` times the drawn weights. Going through 0 would lose
        them, so 0 is approached (1e-6) rather than reached."""
        scale = max(scale, 1e-6)
        for w in self.weights:
            w.mul_(scale / self.scale)
        self.scale = scale


@dataclass
class Calibration:
    wanted: float
    scale: float
    acceptance: float  # what the SD runs measured at `scale`
    tried: list[tuple[float, float]] = field(default_factory=list)  # (scale, acceptance) in the order run


def calibrate(dial: DeepScale, measure: Callable[[], float], wanted: float, steps: int = 6,
              known: Sequence[tuple[float, float]] = (), start: float = 1.0, ceiling: float = 64.0,
              tolerance: float = 0.02) -> Calibration:
    """The scale whose measured acceptance is closest to `wanted`, by bracketing then bisection
    on log(scale); `measure()` runs a few short SD rounds at the dial's current setting.
    `known`: (scale, acceptance) pairs measured before (another level's calibration on the same
    models): they narrow the bracket, so later levels take fewer runs."""
    tried: list[tuple[float, float]] = []

    def at(scale: float) -> float:
        dial.set(scale)
        acceptance = measure()
        tried.append((scale, acceptance))
        log.info("calibrating towards acceptance %.2f: scale %.4g gives %.3f", wanted, scale, acceptance)
        return acceptance

    above = [sc for sc, a in known if a > wanted]  # acceptance falls as the scale grows
    below = [sc for sc, a in known if a <= wanted]
    lo = max(above, default=1e-3)  # acceptance(1e-3) ~ 1: the deep layers all but silent
    hi = min(below, default=None)
    if hi is None:
        hi = max(start, lo)
        while at(hi) > wanted and hi < ceiling:
            lo, hi = hi, hi * 4
    for _ in range(steps):
        close = [t for t in [*known, *tried] if abs(t[1] - wanted) < tolerance]
        if close:
            break
        mid = math.sqrt(lo * hi)
        if at(mid) > wanted:
            lo = mid
        else:
            hi = mid
    scale, acceptance = min([*tried, *known], key=lambda t: abs(t[1] - wanted))
    dial.set(scale)
    return Calibration(wanted, scale, acceptance, tried)
