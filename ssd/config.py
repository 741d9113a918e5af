"""All configuration in one place: dataclasses, loaded from YAML.

Unknown keys are an error (a typo must never be silently ignored), and every
value is checked once here so the rest of the code can trust it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ssd.fields import COUPLINGS, SAMPLING, SERVER_DEFAULTS, FieldError, RequestField  # noqa: F401 - COUPLINGS: ssd.config names it too

AUTO = "auto"  # resolved per host by ssd.models.loading.resolve_precision
DTYPES = ("fp32", "bf16", "fp64", AUTO)
QUANTIZATIONS = (None, "int8", "gguf", AUTO)
MODES = ("ar", "sd", "ssd")
FANOUT_KINDS = ("uniform", "geometric")
BACKUPS = ("neural", "lookup", "ngram", "random")
BRANCH_DECODERS = ("tree", "batched")
# Which kernels run a model: torch (any model, any device), llama.cpp (a GGUF on
# the CPU: ssd.models.llamacpp), or "auto": ssd.models.loading.resolve_backend.
BACKENDS = ("torch", "llamacpp", AUTO)
LLAMACPP_KV = (AUTO, "f16", "bf16/f16", "bf16", "f32")  # model.llamacpp_kv: a llama.cpp KV cache's type (K/V)
# How an SSD cache build starts (ssd.saguaro.builder.build_cache): "fold" feeds
# the one drafted token the draft lacks inside the first branch step (K draft
# forwards a build; bonus branches propose K - 1 tokens); "reuse" feeds it in
# a one-token pass first (K + 1 forwards, full-length bonus branches); "full"
# re-feeds t* and all K drafted tokens (the build before reuse, for ablations).
GLUES = ("fold", "reuse", "full")
PLANNED = ("k", "budget", "glue", "k_policy", "batch_budget")  # what the start-up plan chooses
# How a sampled token is drawn (ssd.sampling): "standard" draws from a seeded
# generator and verifies by rejection sampling (Leviathan et al. 2023);
# "gumbel" takes argmax(log p + g) with Gumbel noise g keyed by (seed,
# position, token), so the output equals AR's for the seed in every mode.


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it."""


@dataclass
class TinyModelConfig:
    """A small random Qwen2-style model for tests: small vocabulary, fixed seed."""

    vocab_size: int = 16
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # Large init so the next-token distributions are far from uniform:
    # statistical tests need distributions with structure to have power.
    initializer_range: float = 0.5
    max_position_embeddings: int = 512
    eos_token_id: int | None = None
    seed: int = 0
    # A tiny draft is the target's config plus relative Gaussian noise on every
    # weight (drawn from noise_seed): it agrees with the target often, not always.
    noise: float = 0.0
    noise_seed: int = 1


@dataclass
class ModelConfig:
    """Which model to load and how.

    name: a hub id, a local directory, a name from the offline registry
    (ssd.models.offline), or "tiny" (built from `tiny`).
    """

    name: str = "tiny"
    dtype: str = "fp32"
    # "int8": int8 weights with per-row int8 activations (CPU, ssd.models.quant).
    # "gguf": the GGUF file's own Q4_K/Q6_K weights on ssd's row-invariant CPU kernels
    # (ssd.models.kernels; torch backend, fp32 activations).
    # "auto" (either field): the fastest precision this host runs exactly;
    # see ssd.models.loading.resolve_precision.
    quantization: str | None = None
    # int8: keep the quantized weights on disk (ssd.models.qcache) so later
    # starts skip the fp32 read and the quantization; SSD_QUANT_CACHE=0 also turns it off.
    cache_quantized: bool = True
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    # "auto": for a model that ships as a GGUF (an offline registry name or a
    # .gguf file) on a CPU at precision "auto" (dtype and quantization), the
    # file's own weights on llama.cpp or on ssd's GGUF kernels, whichever a
    # probe times faster on this host (ssd.models.gguf_choice); torch otherwise.
    backend: str = AUTO
    # llama.cpp: the most tokens one request holds (prompt + output); each
    # sequence's KV cache is allocated for it up front. Default min(trained
    # context, 4096). torch models hold their trained context.
    max_model_len: int | None = None
    # llama.cpp: its repacked weight layouts (llama.cpp's default; one read of a
    # quantized weight serves several rows). None: where they run on this host
    # (a probe in a child process, cached); false: plain layouts.
    llamacpp_repack: bool | None = None
    # llama.cpp: the KV cache's type, keys/values. "auto": the invariance probe's ("bf16/f16"
    # on the real pair: exact, decoding as fast as llama.cpp's F16 cache); "f16": llama.cpp's
    # own, where batched rows and verifications part from lone steps past 256 positions
    # (docs/llamacpp.md); "bf16": exact, F32 sums of the values, a step 5-20% dearer at
    # 1200-2400 positions; "f32".
    llamacpp_kv: str = AUTO

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"model.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.llamacpp_kv not in LLAMACPP_KV:
            raise ConfigError(f"model.llamacpp_kv must be one of {LLAMACPP_KV}, got {self.llamacpp_kv!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"model.max_model_len must be >= 1, got {self.max_model_len}")
        if self.backend == "llamacpp" and (self.quantization in ("int8", "gguf") or self.dtype in ("bf16", "fp64")):
            raise ConfigError(
                f"model.backend llamacpp runs the GGUF's own weight types; model.dtype {self.dtype!r} and "
                f"model.quantization {self.quantization!r} are torch's (leave them auto or fp32/null)"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"model.quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )


@dataclass
class SamplingConfig:
    """Per-request sampling; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    min_p: float = 0.0  # 0.0: off; else drop tokens below min_p x the likeliest's probability
    seed: int = 0
    coupling: str = "standard"  # standard | gumbel: see COUPLINGS and docs/exactness.md

    def __post_init__(self) -> None:
        check_fields(self, SAMPLING, "sampling")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def coupled(self) -> bool:
        """Sampled tokens are Gumbel-max draws under the request's keyed noise (greedy is greedy either way)."""
        return self.coupling == "gumbel" and not self.greedy

    @property
    def needs_q(self) -> bool:
        """Verification reads the draft's q rows: only the standard sampler's
        ratio test does; greedy and coupled drafts are checked against the
        target's own choice."""
        return not (self.greedy or self.coupled)


@dataclass
class GenerationConfig:
    """When generation ends."""

    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's: neither EOS nor a stop token (banned from the law: ssd.engine.processing)
    # nor a stop string ends the output before this many tokens.
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: each ends the output, kept in it
    include_stop_str_in_output: bool = False  # vLLM's: the text keeps the stop string that ended it
    skip_special_tokens: bool = True  # the text leaves special tokens out (vLLM's and HF's default)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ConfigError(f"min_tokens must be in 0..max_new_tokens ({self.max_new_tokens}), got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")


@dataclass
class RequestDefaults:
    """What a served request gets for a field it omits (ssd.serve.validation).

    None (the default for every field): OpenAI's documented default, which
    clients assume: temperature 1, top_p 1, no top-k or min-p, a fresh random seed per
    request, and max_new_tokens up to the context (the model's length minus
    the prompt, within serve.max_new_tokens). A value here is the server's
    own default; /v1/models and the gRPC ModelInfo report which apply. The
    `sampling` and `generation` sections are the CLI's and the benches', not
    a server's.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    # None: coupled sampling (gumbel) for a seeded request, so that the same request gives
    # the same output in every mode whatever the timing (an SSD build cut short or a cache
    # miss would change standard sampling's draws); sampling.coupling for an unseeded one.
    coupling: str | None = None

    def __post_init__(self) -> None:
        check_fields(self, SERVER_DEFAULTS, "serve_defaults")


def check_fields(record: Any, fields: tuple[RequestField, ...], section: str) -> None:
    """Each of the request fields `record` holds, by the one table's rules (ssd.fields)."""
    for spec in fields:
        try:
            spec.check(getattr(record, spec.name))
        except FieldError as error:
            raise ConfigError(f"{section}.{error}") from None


@dataclass
class FanoutConfig:
    """How SSD spends its branch budget over acceptance lengths 0..K."""

    kind: str = "geometric"  # uniform | geometric (F_k ~ P(k)^(1/(1+r)))
    budget: int = 16  # B: branches prepared per round, sum of F_k
    initial_a: float = 0.7  # acceptance rate assumed before any round is seen
    initial_r: float = 1.0  # power-law exponent of miss rate vs fan-out, ditto
    refresh_every: int = 16  # rounds between schedule refreshes from online estimates
    # Branches prepared per round across a whole batch (SSD at batch > 1): the
    # draft's cache builds for all rows share one round's time, so their total
    # must stay bounded as the batch grows. Over the cap, every row keeps one
    # branch and the rest is split in proportion to the rows' own budgets
    # (ssd.saguaro.fanout.share_budget); each row's schedule keeps its shape. With
    # rows of different settings the tightest cap applies. None: no cap.
    batch_budget: int | None = None
    # Anytime build: `budget` is only where the draft starts. Each build stops
    # when the target's outcome arrives (answering from the branches it has),
    # and the budget then follows the round: a quarter less after a cut, one
    # more after a build that left the draft waiting (ssd.saguaro.anytime),
    # up to `max_budget` (None: max(2 * budget, budget + 4)). false: every
    # build runs to `budget` whatever the wait.
    anytime: bool = True
    max_budget: int | None = None

    @property
    def ceiling(self) -> int:
        """The most branches a row's build may take."""
        if not self.anytime:
            return self.budget
        return self.max_budget if self.max_budget is not None else min(4096, max(2 * self.budget, self.budget + 4))

    def __post_init__(self) -> None:
        if self.kind not in FANOUT_KINDS:
            raise ConfigError(f"fanout.kind must be one of {FANOUT_KINDS}, got {self.kind!r}")
        if not 1 <= self.budget <= 4096:
            raise ConfigError(f"fanout.budget must be in 1..4096, got {self.budget}")
        if not 0 <= self.initial_a <= 1:
            raise ConfigError(f"fanout.initial_a must be in [0, 1], got {self.initial_a}")
        if not self.initial_r > 0:
            raise ConfigError(f"fanout.initial_r must be > 0, got {self.initial_r}")
        if self.refresh_every < 1:
            raise ConfigError(f"fanout.refresh_every must be >= 1, got {self.refresh_every}")
        if self.max_budget is not None and not self.budget <= self.max_budget <= 4096:
            raise ConfigError(f"fanout.max_budget must be in budget..4096 or null, got {self.max_budget}")
        if self.batch_budget is not None and self.batch_budget < 1:
            raise ConfigError(f"fanout.batch_budget must be >= 1 or null, got {self.batch_budget}")


@dataclass
class DraftVocabConfig:
    """The draft's LM head over the `size` most frequent tokens (FR-Spec; ssd.models.vocab).

    q is zero outside the subset and verification uses that q, so the output
    law is unchanged; the draft's step reads size / V of its head. size 0
    (or >= the vocabulary): the full head. source: a token ranking file
    written by `python launch/vocab_rank.py` (relative paths: from the
    repository root if absent here); the shipped one ranks Qwen2.5's tokens.
    Torch drafts only (llama.cpp computes the full head; it is ignored there).
    """

    size: int = 0
    source: str = "configs/vocab/qwen2.5-coder.json"

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise ConfigError(f"speculation.draft_vocab.size must be an integer >= 0, got {self.size!r}")
        if self.size and not self.source:
            raise ConfigError("speculation.draft_vocab.source must name a token ranking file when size > 0")


@dataclass
class PromptLookupConfig:
    """Prompt lookup on plain target steps (ssd.engine.lookup): where a row's round
    would draft nothing (K 0 by k_policy, as the start-up plan sets where the
    draft's core is worth more to the target; an SSD round without the draft),
    the target verifies the tokens that followed the latest earlier occurrence
    of the text's last n tokens (n = max_n down to min_n), up to max_tokens of
    them (None: the row's K, so admission reserves nothing more), as many as the
    row's acceptance and the forward's measured cost of a token make worth it.
    No model cost; exact (a one-hot q). max_tokens 0: off.
    """

    max_tokens: int | None = None
    min_n: int = 2
    max_n: int = 8

    def __post_init__(self) -> None:
        bad = isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, (int, type(None)))
        if bad or (self.max_tokens is not None and not 0 <= self.max_tokens <= 64):
            raise ConfigError(
                f"speculation.prompt_lookup.max_tokens must be in 0..64 or null (the row's K), got {self.max_tokens!r}"
            )
        if not 1 <= self.min_n <= self.max_n <= 64:
            raise ConfigError(
                f"speculation.prompt_lookup needs 1 <= min_n <= max_n <= 64, got min_n {self.min_n}, max_n {self.max_n}"
            )


@dataclass
class SpeculationConfig:
    mode: str = "sd"
    k: int = 4  # drafted tokens per round
    fanout: FanoutConfig = field(default_factory=FanoutConfig)
    saguaro_c: float = 1.0  # Saguaro sampling constant; 1 disables it
    backup: str = "neural"  # speculator on a cache miss
    # Backup by batch size: {from_batch_size: backup}; {1: neural, 8: ngram}
    # uses neural below 8 sequences and ngram from 8 on. Empty: always `backup`.
    backup_policy: dict[int, str] = field(default_factory=dict)
    # Free cache entries: for each acceptance length, the outcome the text so
    # far predicts (prompt lookup: what followed the latest earlier occurrence
    # of the context's last 2-3 tokens) with what followed it, where the draft
    # built nothing for it. No model cost; exact (a one-hot q).
    ngram_candidates: bool = True
    branch_decoder: str = "tree"  # tree (one row, tree mask) | batched (expanded KV)
    glue: str = "fold"  # fold | reuse | full: see GLUES
    # K by batch size for batched SD: {smallest batch size: K}, K 0 = speculation
    # off (plain AR steps), e.g. {1: 4, 4: 2, 8: 0}; empty: always k. Computed
    # from measured costs by `python launch/calibrate.py`; a request that asks
    # for its own K runs with that K. SSD reads only its K 0 entries: past that
    # batch size its rows leave the draft and run plain target steps, and come
    # back (prefilled on the draft again) when the batch shrinks.
    k_policy: dict[int, int] = field(default_factory=dict)
    # SSD: K follows the measured round (ssd.saguaro.adaptive_k): the target picks
    # each round's K in 1..max_k from its rounds' times and acceptance, starting
    # at k (the config's or the start-up plan's), and tells the draft in each
    # rounds message. Off: every round drafts k.
    adaptive_k: bool = False
    max_k: int = 8
    # The draft's LM head over a frequency-ranked vocabulary subset (FR-Spec); size 0: full.
    draft_vocab: DraftVocabConfig = field(default_factory=DraftVocabConfig)
    prompt_lookup: PromptLookupConfig = field(default_factory=PromptLookupConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"speculation.mode must be one of {MODES}, got {self.mode!r}")
        if not 1 <= self.k <= 64:
            raise ConfigError(f"speculation.k must be in 1..64, got {self.k}")
        if not 1 <= self.max_k <= 64:
            raise ConfigError(f"speculation.max_k must be in 1..64, got {self.max_k}")
        if not 0 <= self.saguaro_c <= 1:
            raise ConfigError(f"speculation.saguaro_c must be in [0, 1], got {self.saguaro_c}")
        for name in [self.backup, *self.backup_policy.values()]:
            if name not in BACKUPS:
                raise ConfigError(f"speculation.backup must be one of {BACKUPS}, got {name!r}")
        if any(not isinstance(n, int) or n < 1 for n in self.backup_policy):
            raise ConfigError("speculation.backup_policy keys must be batch sizes >= 1")
        if any(not isinstance(n, int) or n < 1 for n in self.k_policy):
            raise ConfigError("speculation.k_policy keys must be batch sizes >= 1")
        if any(not isinstance(k, int) or not 0 <= k <= 64 for k in self.k_policy.values()):
            raise ConfigError(f"speculation.k_policy values must be K in 0..64 (0: speculation off), got {self.k_policy}")
        if self.glue not in GLUES:
            raise ConfigError(f"speculation.glue must be one of {GLUES}, got {self.glue!r}")
        if self.branch_decoder not in BRANCH_DECODERS:
            raise ConfigError(
                f"speculation.branch_decoder must be one of {BRANCH_DECODERS}, got {self.branch_decoder!r}"
            )

    def k_for(self, batch_size: int) -> int:
        """The draft length at this batch size: the rule with the largest threshold <= it."""
        rules = [n for n in self.k_policy if n <= batch_size]
        return self.k_policy[max(rules)] if rules else self.k

    @property
    def k_ceiling(self) -> int:
        """The longest speculation a round may draft: max_k under adaptive_k (never below k), else k."""
        return max(self.k, self.max_k) if self.adaptive_k else self.k

    @property
    def round_ceiling(self) -> int:
        """The most tokens a round may verify before its last: its longest speculation or prompt lookup."""
        return max(self.k_ceiling, self.prompt_lookup.max_tokens or 0)

    @property
    def lookup_ceiling(self) -> int:
        """The most tokens a prompt lookup may propose in a round (0: lookups off)."""
        lookup = self.prompt_lookup.max_tokens
        return self.k_ceiling if lookup is None else lookup

    def backup_for(self, batch_size: int) -> str:
        """The backup for this batch size: the rule with the largest threshold <= it."""
        rules = [n for n in self.backup_policy if n <= batch_size]
        return self.backup_policy[max(rules)] if rules else self.backup


@dataclass
class RuntimeConfig:
    threads: int | None = None  # torch intra-op threads; None: torch's default
    # SSD: time this host when the cluster or server starts and pick the
    # speculation's K, fan-out budget and glue (ssd.saguaro.startup; cached
    # per host, model pair and precision). `plan_keeps` names the settings
    # the plan must leave as configured (--k, --budget, --glue add theirs).
    plan: bool = False
    plan_keeps: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        bad = [name for name in self.plan_keeps if name not in PLANNED]
        if bad:
            raise ConfigError(f"runtime.plan_keeps must name settings among {PLANNED}, got {bad}")


@dataclass
class BatchingConfig:
    """Continuous batching (ssd.engine.batch): how many requests run together."""

    max_rows: int = 8  # requests decoding together; beyond, they queue. 1: one at a time
    max_batched_tokens: int = 2048  # tokens in one batched forward (prefill chunks + rounds)
    prefill_chunk: int = 512  # a long prompt is prefilled this many tokens per step
    kv_memory_mb: float = 4096.0  # KV cache of all rows together; a request that would exceed it waits
    # Keep finished rows' caches for later prompts that start the same way (ssd.engine.prefix):
    # whole prompt chunks only, so outputs stay bit for bit what they are without it. They use
    # memory and llama.cpp slots no running row needs, and go first when one does.
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_batched_tokens", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"batching.{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_chunk > self.max_batched_tokens:
            raise ConfigError(
                f"batching.prefill_chunk ({self.prefill_chunk}) must not exceed "
                f"batching.max_batched_tokens ({self.max_batched_tokens})"
            )
        if not self.kv_memory_mb > 0:
            raise ConfigError(f"batching.kv_memory_mb must be > 0, got {self.kv_memory_mb}")


@dataclass
class ClusterConfig:
    """The distributed runtime (launch/cluster.py)."""

    # A draft that answers no round within this time is treated as lost: the
    # target finishes the request alone and the draft is restarted.
    draft_timeout_s: float = 30.0
    # The draft link carries host-memory payloads (token ids, q rows) and must
    # survive a lost peer: gloo. (NCCL point-to-point blocks the GPU, and a
    # timed-out NCCL wait aborts the communicator and, by default, the process.)
    link_backend: str = "gloo"
    # Where the actors compute. None: as placed (GPUs when --target-gpus is
    # given). "cpu": GPU-placed actors compute on the CPU; for orchestration
    # tests on machines without GPUs, and for debugging.
    compute_device: str | None = None
    # How long a target rank or the draft may take to load. None: 300 s plus
    # one second per 100 MB of the model's weights (ssd.cluster.runtime).
    start_timeout_s: float | None = None
    # Independent target + draft groups behind one endpoint (ssd.cluster.replicas),
    # each packed on a node of its own where the Ray cluster has room.
    replicas: int = 1
    # The node the speculator runs on, apart from the target (its Ray node ID
    # in hex, or its IP address); the link then runs over TCP between the hosts.
    # None: beside the target, in its placement group.
    draft_node: str | None = None
    # With replicas: a replica whose batched step has not returned within this
    # time is treated as lost (its target restarts; its rows that streamed
    # nothing move to another replica), while the others step on.
    step_deadline_s: float = 60.0
    # One batched step call on the target keeps stepping until this much time
    # has passed, a row has left or the batch is empty (at least one step), so
    # fast steps (small models, GPUs) pay the Ray call's few milliseconds once
    # for several steps; the tokens stream, and new requests and cancels are
    # taken, at each return. 0: one step per call. A step longer than this
    # (the real pair on a CPU core) runs one step per call either way.
    step_call_s: float = 0.025
    # A second target, loaded and idle, per replica (tensor-parallel size 1):
    # it takes over when the target dies, so serving resumes in seconds rather
    # than a model load. Costs the target's memory twice; a new standby loads
    # in the background after each takeover.
    warm_standby: bool = False
    # A tensor-parallel target's collectives fail past this wait, so a hung rank is noticed
    # (and the group restarted) within it; idle ranks are kept from it by a keepalive (ssd.models.tp).
    tp_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.step_deadline_s > 0:
            raise ConfigError(f"cluster.step_deadline_s must be > 0, got {self.step_deadline_s}")
        call = self.step_call_s
        if isinstance(call, bool) or not isinstance(call, (int, float)) or not 0 <= call < self.step_deadline_s:
            raise ConfigError(f"cluster.step_call_s must be >= 0 and below cluster.step_deadline_s "
                              f"({self.step_deadline_s:g}), got {call!r}")
        if not isinstance(self.warm_standby, bool):
            raise ConfigError(f"cluster.warm_standby must be true or false, got {self.warm_standby!r}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError(f"cluster.replicas (--replicas) must be an integer >= 1, got {self.replicas!r}")
        if self.draft_node is not None and not str(self.draft_node).strip():
            raise ConfigError("cluster.draft_node must name a node (Ray node ID or IP address) or be null")
        if self.start_timeout_s is not None and not self.start_timeout_s > 0:
            raise ConfigError(f"cluster.start_timeout_s must be > 0 or null, got {self.start_timeout_s}")
        if not self.draft_timeout_s > 0:
            raise ConfigError(f"cluster.draft_timeout_s must be > 0, got {self.draft_timeout_s}")
        if not self.tp_timeout_s > 0:
            raise ConfigError(f"cluster.tp_timeout_s must be > 0, got {self.tp_timeout_s}")
        if self.link_backend != "gloo":
            raise ConfigError(
                f"cluster.link_backend must be gloo (the link carries host-memory token ids and q rows, "
                f"and an NCCL link does not survive a lost draft), got {self.link_backend!r}"
            )
        if self.compute_device not in (None, "cpu"):
            raise ConfigError(f"cluster.compute_device must be null or cpu, got {self.compute_device!r}")


@dataclass
class Config:
    target: ModelConfig = field(default_factory=ModelConfig)
    draft: ModelConfig = field(default_factory=lambda: ModelConfig(tiny=TinyModelConfig(seed=1)))
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    serve_defaults: RequestDefaults = field(default_factory=RequestDefaults)
    prompt: str = "def fibonacci(n):"


def from_dict(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, refusing unknown keys."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}: " if path else ""
        raise ConfigError(f"unknown config key(s): {where}{', '.join(unknown)}")
    kwargs = {}
    for name, value in data.items():
        sub = _dataclass_in(hints[name])
        key = f"{path}.{name}" if path else name
        kwargs[name] = from_dict(sub, value, key) if sub and value is not None else value
    return cls(**kwargs)


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass type named by a field's hint (also inside `X | None`)."""
    if dataclasses.is_dataclass(hint):
        return hint
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)
    return None


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Load a YAML config file; `overrides` are merged on top (nested dicts)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if overrides:
        data = _merge(data, overrides)
    return from_dict(Config, data)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
