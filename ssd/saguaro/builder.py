"""Building the speculation cache while the target verifies.

One draft pass over [t', s1..sK] (the "glue") gives the draft's distribution
at every acceptance length k; the top-F_k tokens there (for k < K without
s_{k+1}, which a rejection can never produce) are the guessed outcomes
(k, t*). Then K decode steps run for all guessed branches at once.

The draft computed most of the glue already: s1..sK came from a cache
branch or a backup chain that fed t', s1..s_{K-1} and kept their logits
(DraftWork). From there only s_K is new, and it rides in the first branch
step (`build_cache`): a build is K draft forwards, not K + 1.

Everything stays on the draft's device: each step's sampled ids feed the next
step from there, and the host reads the guesses once and every branch's
tokens once, at the end.

Coupled sampling (sampling.coupling: gumbel): a branch draws each token as
the Gumbel-max of q under the request's noise at that token's position, as
the target will; and the guesses of t* are ranked by the same perturbed
scores log q + g at their positions, not by raw logits. Under shared noise t*
is the target's argmax of log p + g; with p close to q the draft's own
argmax of log q + g is its best single guess for the bonus, and after a
rejection (t* differs from the draft's argmax there) its runner-up, and so
on down the perturbed ranking (docs/exactness.md, docs/results/coupling.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Sequence

import torch

from ssd.config import SamplingConfig
from ssd.models.backend import feed_rows
from ssd.models.kv import Feed, KVSequence, token_tensor
from ssd.sampling import (
    DRAFT_CANDIDATES, GumbelNoise, as_drawn, coupled_scores, draws_at, probs_from_logits, sample_ids,
)
from ssd.saguaro.branches import BranchDecoder, TreeBranchDecoder
from ssd.saguaro.cache import DraftWork, Proposal
from ssd.saguaro.fanout import fanout_for
from ssd.saguaro.sampling import Saguaro

Entries = dict[tuple[int, int], Proposal]

# An anytime build keeps at least this many tokens per branch: the bonus branches
# of a folded build join at step 1, and the outcome "all accepted" is the likeliest.
MIN_CUT_STEPS = 2


def guessed_outcomes(glue_logits: torch.Tensor, drafted: Sequence[int], fanout: Sequence[int]) -> list[tuple[int, int]]:
    """(k, t*) pairs to prepare: the top-F_k draft tokens at each acceptance length.

    Ranked by raw logits, so greedy decoding (one-hot q) still gets F_k
    distinct guesses per position. One top-k over all rows, one host read.
    """
    vocab = glue_logits.shape[-1]
    widest = max(fanout, default=0)
    if widest <= 0:
        return []
    # One spare candidate per row: a rejection never yields the drafted token.
    ranked = torch.topk(glue_logits[: len(fanout)], min(widest + 1, vocab), dim=-1).indices.tolist()
    branches = []
    for k, f in enumerate(fanout):
        if f <= 0:
            continue
        if k < len(drafted):  # V - 1 candidates here
            branches += [(k, t) for t in ranked[k] if t != drafted[k]][: min(f, vocab - 1)]
        else:
            branches += [(k, t) for t in ranked[k][: min(f, vocab)]]
    return branches


def guess_scores(logits: torch.Tensor, sampling: SamplingConfig, first: int) -> torch.Tensor:
    """What the guesses of t* are ranked by, rows [n, V] after the draft's
    logits for the tokens at positions first .. first + n - 1: the raw logits,
    or under coupling the perturbed scores log q + g at those positions (the
    Gumbel-max that picks t* is taken over the same noise), over each row's
    DRAFT_CANDIDATES likeliest tokens (-inf elsewhere)."""
    if not sampling.coupled:
        return logits
    noise = GumbelNoise(sampling.seed, tuple(range(first, first + logits.shape[0])), DRAFT_CANDIDATES)
    return coupled_scores(probs_from_logits(logits, sampling), noise)


def glue_pass(kv: KVSequence, committed: Sequence[int], drafted: Sequence[int]) -> torch.Tensor:
    """Draft logits [K+1, V] after committed[-1] and after each drafted token."""
    kv.trim_to_prefix_of(committed)
    sequence = list(committed) + list(drafted)
    rows = kv.forward(sequence[kv.length :])
    return rows[-(len(drafted) + 1) :]


def resume(kv: KVSequence, committed: Sequence[int], drafted: Sequence[int], work: DraftWork | None) -> torch.Tensor | None:
    """The glue rows the draft computed already ([len(drafted), V]: after
    committed[-1] and each drafted token but the last), with `kv` then holding
    committed + drafted[:-1]; None where the cache does not hold that work.

    A hit's branch is committed out of the tree's entries; a backup chain left
    exactly that in the cache. Anything else (a re-prefill, an n-gram backup,
    the other branch decoder) starts from a full glue pass.
    """
    if work is None or len(work.logits) != len(drafted) or not drafted:
        return None
    head = len(committed) - 1
    if work.indices is not None:
        if not kv.lean or kv.tokens[:head] != list(committed[:head]) or len(work.indices) != len(drafted):
            return None
        kv.keep_branch(head, work.indices, [committed[-1], *drafted[:-1]])
    if kv.cached != kv.length or kv.tokens != [*committed, *drafted[:-1]]:
        return None
    return torch.stack(work.logits)


@dataclass
class BuildJob:
    """One sequence's cache build (the arguments of `build_cache`)."""

    kv: KVSequence
    decoder: BranchDecoder
    committed: Sequence[int]
    drafted: Sequence[int]
    fanout: Sequence[int]
    sampling: SamplingConfig
    gen: torch.Generator
    saguaro: Saguaro | None = None
    work: DraftWork | None = None
    depth: int | None = None
    glue: str = "fold"
    stop: Callable[[], bool] | None = None  # the anytime build's: see build_caches


def build_cache(
    kv: KVSequence,
    decoder: BranchDecoder,
    committed: Sequence[int],
    drafted: Sequence[int],
    fanout: Sequence[int],
    sampling: SamplingConfig,
    gen: torch.Generator,
    saguaro: Saguaro | None = None,
    work: DraftWork | None = None,
    depth: int | None = None,
    glue: str = "fold",
) -> Entries:
    """Speculations for every guessed outcome of verifying `drafted` after `committed`.

    fanout: F_k for k = 0..K, the schedule for a K-token speculation; a
    shorter one (a bonus branch's, see below) has fewer outcomes and its last
    position takes the rest of the budget. depth: tokens per prepared
    speculation (default: len(drafted)). saguaro: Saguaro sampling for the prepared
    speculations, with the schedule that will be in force when one of them is
    verified (the after-hit schedule). work: what the draft computed for
    `drafted` already (its Proposal's), so the glue pass shrinks (glue, one
    of ssd.config.GLUES):
    - "reuse": from the work on, a build needs the logits after drafted[-1]
      only, a one-token pass;
    - "fold" (tree decoder, depth >= 2): that token rides in the first branch
      step, so the build is K forwards instead of K + 1. Its bonus branches
      (k = K, guessed from those logits) join one step later and so propose
      depth - 1 tokens: a draft that is often right all the way pays for the
      forward it saves (the start-up plan weighs both, ssd.saguaro.plan);
    - "full": the whole glue pass, work or not.
    """
    job = BuildJob(kv, decoder, committed, drafted, fanout, sampling, gen, saguaro, work, depth, glue)
    result = build_caches([job])[0]
    if isinstance(result, BaseException):
        raise result
    return result


def build_caches(jobs: Sequence[BuildJob]) -> list[Entries | Exception]:
    """Every job's build in lockstep: each step's draft forwards of all rows run
    as ONE packed forward (ssd.models.kv.feed_rows), so b rows cost about K
    forwards of b times the tokens, not b x K forwards. A row whose own work
    fails (its sampling, say) gets its exception and the others go on; a
    failed forward is every row's in it.

    A job's `stop` is asked before each branch step from MIN_CUT_STEPS on; once
    it says True the job's build ends there and every branch keeps the tokens
    it has (an anytime build: the target's outcome arrived, and an answer
    now beats a deeper cache later). Shorter speculations are as exact as
    full ones.
    """
    steps = [_build_steps(job) for job in jobs]
    results: list[Entries | Exception | None] = [None] * len(jobs)
    pending: dict[int, Feed] = {}

    def advance(i: int, send: Callable[[], Feed]) -> None:
        try:
            pending[i] = send()
        except StopIteration as done:
            results[i] = done.value
        except Exception as exc:  # noqa: BLE001 - this row's failure, returned with it
            results[i] = exc

    for i, row in enumerate(steps):
        advance(i, row.__next__)
    while pending:
        rows, feeds = list(pending), list(pending.values())
        pending.clear()
        try:
            outs: list = feed_rows(feeds)
        except Exception as exc:  # noqa: BLE001 - the forward was every row's in it
            outs = [exc] * len(rows)
        for i, out in zip(rows, outs):
            advance(i, (lambda g=steps[i], e=out: g.throw(e)) if isinstance(out, BaseException)
                    else (lambda g=steps[i], o=out: g.send(o)))
    return results  # type: ignore[return-value]


def _build_steps(job: BuildJob) -> Generator[Feed, torch.Tensor, Entries]:
    """One row's build, yielding each draft forward for `build_caches` to run."""
    kv, decoder, committed, drafted = job.kv, job.decoder, job.committed, job.drafted
    depth = len(drafted) if job.depth is None else job.depth
    fanout = fanout_for(job.fanout, len(drafted))
    base = len(committed)  # the position of t* after 0 accepted drafts
    keep = isinstance(decoder, TreeBranchDecoder) and kv.lean
    grower = _Grower(job.sampling, job.gen, job.saguaro, base, keep=keep, stop=job.stop)
    known = None if job.glue == "full" else resume(kv, committed, drafted, job.work)
    if known is not None and job.glue == "fold" and depth >= 2 and grower.keep:
        early = guessed_outcomes(guess_scores(known, job.sampling, base), drafted, fanout[:-1])
        if early:
            return (yield from grower.folded(kv, decoder, committed, drafted, fanout[-1], early, depth))
    if known is not None:
        glue = torch.cat([known, (yield Feed(kv, drafted[-1:], 1))])  # one token instead of K + 1
    else:
        kv.trim_to_prefix_of(committed)
        sequence = [*committed, *drafted]
        glue = (yield Feed(kv, sequence[kv.length :], len(sequence) - kv.length))[-(len(drafted) + 1) :]
    branches = guessed_outcomes(guess_scores(glue, job.sampling, base), drafted, fanout)
    if not branches:
        return {}
    prefixes, firsts = [len(committed) + k for k, _ in branches], [t for _, t in branches]
    logits = yield from _step(decoder, lambda: decoder.open(kv, prefixes, firsts), lambda: decoder.start(kv, prefixes, firsts))
    return (yield from grower.grow(decoder, logits, branches, depth))


def _step(decoder: BranchDecoder, prepare: Callable[[], Feed], run_alone: Callable[[], torch.Tensor]):
    """A branch step: yielded to run with the other rows' (the tree decoder),
    or run alone (the batched decoder, which decodes over its own cache copy)."""
    if not isinstance(decoder, TreeBranchDecoder):
        return run_alone()
    feed = prepare()
    try:
        logits = yield feed
    except BaseException:
        decoder.finish()  # a failed forward may have grown some layers only
        raise
    decoder.fed()
    return logits


class _Grower:
    """Decodes the branches of one build step by step and turns them into cache entries.

    Draws stay on the draft's device: each step's ids feed the next step from
    there, and the host reads every branch's tokens once, at the end. With
    `keep`, the branches' cache entries outlive the build and each entry
    carries its DraftWork, for the next build to resume from.
    """

    def __init__(
        self, sampling: SamplingConfig, gen: torch.Generator, saguaro: Saguaro | None, base: int, keep: bool,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """`base`: the position of t* after 0 accepted drafts (len(committed)); a
        branch (k, t*) draws its tokens from position base + k + 1 on. `stop`: the
        anytime build's (see build_caches)."""
        self.sampling, self.gen, self.saguaro, self.keep = sampling, gen, saguaro, keep
        self.base = base
        self.stop = stop

    def folded(self, kv, decoder: TreeBranchDecoder, committed, drafted, bonus_fanout: int, early, depth: int) -> Entries:
        """The first step feeds drafted[-1] (committed) and the early branches'
        first tokens; the bonus branches, guessed from the logits after
        drafted[-1], join at the second step."""
        prefixes, firsts = [len(committed) + k for k, _ in early], [t for _, t in early]
        first = yield from _step(decoder, lambda: decoder.open(kv, prefixes, firsts, lead=drafted[-1]), None)
        k = len(drafted)
        scores = guess_scores(first[:1], self.sampling, self.base + k)
        bonus = guessed_outcomes(scores, (), [bonus_fanout]) if bonus_fanout > 0 else []
        bonus = [(k, t) for _, t in bonus]
        return (yield from self.grow(decoder, first[1:], early, depth, late=bonus, late_prefix=len(committed) + k))

    def grow(self, decoder, logits: torch.Tensor, branches, steps: int, late=(), late_prefix: int = 0) -> Entries:
        """`steps` tokens for each of `branches` (logits: after their first
        tokens) and steps - 1 for each `late` branch (joining at step 2)."""
        ids: list[torch.Tensor] = []  # [step] -> [active branches], on the draft's device
        q: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []  # [step] -> logits of the active branches
        try:
            for step in range(steps):
                if step:
                    if step >= MIN_CUT_STEPS and self.stop is not None and self.stop():
                        break  # the outcome arrived: answer from the branches as they are
                    if step == 1 and late:
                        decoder.join([late_prefix] * len(late), [t for _, t in late])
                    tokens = ids[-1]
                    logits = yield from _step(decoder, lambda: decoder.next(tokens), lambda: decoder.step(tokens))
                rows.append(logits)
                step_ids, step_q = self._draw(logits, step, len(branches), self._positions(step, branches, late))
                ids.append(step_ids)
                if step_q is not None:
                    q.append(step_q)
        except BaseException:
            decoder.finish()  # a failed row keeps nothing
            raise
        fed = decoder.fed_indices() if self.keep else None
        decoder.detach() if self.keep else decoder.finish()
        late = list(late) if len(ids) > 1 else []  # cut before they joined: nothing of theirs
        return self._entries(list(branches), late, ids, q, rows, fed)

    def _positions(self, step: int, early, late) -> list[int]:
        """The positions of the tokens each active branch draws at `step` (late
        branches, joined at step 1, are one token behind)."""
        positions = [self.base + k + 1 + step for k, _ in early]
        return positions + ([self.base + k + step for k, _ in late] if step else [])

    def _draw(
        self, logits: torch.Tensor, step: int, early: int, positions: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next ids of the active branches, and the q rows they were drawn from
        (None: greedy, or coupled, whose verification reads no q)."""
        if self.sampling.greedy:
            return logits.argmax(dim=-1), None
        q = probs_from_logits(logits, self.sampling)
        if self.sampling.coupled:
            return sample_ids(q, draws_at(self.sampling, self.gen, positions, DRAFT_CANDIDATES)), None
        if self.saguaro is not None:  # token positions: `step` for the early branches, one less for late ones
            parts = [self.saguaro.apply_rows(q[:early], step)]
            if q.shape[0] > early:
                parts.append(self.saguaro.apply_rows(q[early:], step - 1))
            q = torch.cat(parts) if len(parts) > 1 else parts[0]
        q = as_drawn(q)  # drawn from the very rows that are shipped (ssd.sampling.as_drawn)
        return token_tensor(sample_ids(q, self.gen), q.device), q

    def _entries(self, early, late, ids, q, rows, fed) -> Entries:
        steps = len(ids)
        host = torch.cat(ids).tolist()  # one host read
        offsets = [sum(len(x) for x in ids[:s]) for s in range(steps)]
        entries: Entries = {}
        for b, key in enumerate(early + late):
            joined = 0 if b < len(early) else 1
            span = range(joined, steps)
            tokens = [host[offsets[s] + b] for s in span]
            q_rows = torch.stack([q[s][b] for s in span]) if q else None
            work = DraftWork([rows[s][b] for s in span], fed[b]) if fed is not None else None
            entries[key] = Proposal(tokens, q_rows, "cache", work)
        return entries
