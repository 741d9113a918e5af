"""What every branch decoder checks before it starts: ssd.saguaro.branches' torch decoders and
ssd.models.llamacpp.LlamaCppBranches share these checks, so that both refuse the same calls
with the same errors."""

from __future__ import annotations

from typing import Sequence


def check_start(active: bool, length: int, prefix_lens: Sequence[int], first_tokens: Sequence[int]) -> None:
    """Refuse a start while branches are `active`, without one first token per branch (and
    at least one branch), or with a prefix past the sequence's `length` tokens."""
    if active:
        raise RuntimeError("branches already active: call finish() first")
    if not prefix_lens or len(prefix_lens) != len(first_tokens):
        raise ValueError(
            f"need one first token per branch and at least one branch "
            f"(got {len(prefix_lens)} prefix lengths, {len(first_tokens)} tokens)"
        )
    check_prefixes(prefix_lens, length)


def check_prefixes(prefix_lens: Sequence[int], length: int) -> None:
    """Refuse a branch prefix outside the sequence's `length` cached tokens."""
    if not all(0 <= p <= length for p in prefix_lens):
        raise ValueError(f"prefix lengths {list(prefix_lens)} must lie in [0, {length}]")
