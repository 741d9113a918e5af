"""What a seed promises on a live server, and what it costs: the same seeded request sent
several times to an SSD server, coupled (Gumbel, the default for a seeded request) against
standard (rejection) sampling, interleaved through one gRPC server on loopback.

Standard sampling's SSD output depends on what the draft proposed, and the anytime build's
proposals depend on where the verification's answer cut it: a seeded request may come back
as another text. Coupled sampling's output is AR's for the seed whatever was proposed. Rows:
distinct texts per prompt over the repeats, outputs equal to AR's, acceptance, cache hit
rate and decode tokens/s.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from tqdm import tqdm

from ssd.config import Config
from ssd.factory import LoadedPair
from ssd.tools.bench.serving import BenchServer

log = logging.getLogger(__name__)

COUPLINGS = ("gumbel", "standard")


@dataclass
class Row:
    """One coupling's requests, every prompt and repeat."""

    coupling: str
    texts: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))  # prompt -> one per repeat
    tokens: int = 0
    decode_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    lookups: int = 0
    hits: int = 0

    def add(self, prompt: int, out: Any) -> None:
        s = out.stats
        self.texts[prompt].append(out.text)
        decoded = max(0, s.new_tokens - 1)  # the first token is the prefill's
        self.tokens += decoded
        self.decode_s += decoded / s.decode_tokens_per_s if s.decode_tokens_per_s > 0 else 0.0
        self.drafted, self.accepted = self.drafted + s.drafted, self.accepted + s.accepted
        self.lookups, self.hits = self.lookups + s.spec.lookups, self.hits + s.spec.hits

    def summary(self, ar: dict[int, str]) -> dict[str, Any]:
        repeated = sum(len(set(texts)) == 1 for texts in self.texts.values())
        equal_ar = sum(text == ar[p] for p, texts in self.texts.items() for text in texts)
        runs = sum(len(texts) for texts in self.texts.values())
        return {"coupling": self.coupling, "prompts": len(self.texts), "runs": runs,
                "prompts_repeated": repeated,
                "distinct_texts": {p: len(set(texts)) for p, texts in self.texts.items()},
                "equal_to_ar": equal_ar, "acceptance": self.accepted / max(1, self.drafted),
                "hit_rate": self.hits / max(1, self.lookups),
                "decode_tok_s": self.tokens / self.decode_s if self.decode_s else 0.0}


def run_seeded_bench(pair: LoadedPair, config: Config, prompts: Sequence[str], temperature: float,
                     repeats: int, max_new_tokens: int) -> dict[str, Any]:
    """Every prompt `repeats` times per coupling, interleaved (prompt i seeded i), then coupled
    AR once per prompt: the text both couplings are compared with (gumbel SSD should equal it)."""
    from ssd.serve.client import GenerationClient

    rows = {c: Row(c) for c in COUPLINGS}
    fields = {"temperature": temperature, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    ar: dict[int, str] = {}
    with BenchServer(pair, config) as address, GenerationClient(address) as client, \
            tqdm(total=len(prompts) * (len(COUPLINGS) * repeats + 1), desc="seeded requests") as bar:
        client.generate(text=prompts[0], mode="ssd", max_new_tokens=4)  # warm: first-call costs out of the rows
        for repeat in range(repeats):
            for i, prompt in enumerate(prompts):
                for coupling in COUPLINGS:
                    out = client.generate(text=prompt, mode="ssd", seed=i, coupling=coupling, **fields)
                    rows[coupling].add(i, out)
                    bar.update()
        for i, prompt in enumerate(prompts):
            ar[i] = client.generate(text=prompt, mode="ar", seed=i, coupling="gumbel", **fields).text
            bar.update()
    return {"temperature": temperature, "repeats": repeats, "max_new_tokens": max_new_tokens,
            "rows": [rows[c].summary(ar) for c in COUPLINGS]}


def format_seeded_table(result: dict[str, Any]) -> str:
    lines = [f"T = {result['temperature']}, {result['repeats']} runs of each prompt, "
             f"{result['max_new_tokens']} tokens",
             "| coupling | prompts whose runs all gave one text | runs equal to coupled AR | acceptance | "
             "hit rate | decode tok/s |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['coupling']} | {r['prompts_repeated']}/{r['prompts']} | {r['equal_to_ar']}/{r['runs']} | "
                     f"{r['acceptance']:.3f} | {r['hit_rate']:.3f} | {r['decode_tok_s']:.2f} |")
    return "\n".join(lines)
