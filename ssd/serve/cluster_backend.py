"""The server's backend over the distributed runtime: requests go to target
rank 0 as one streaming Ray call each; rounds stream back as they land."""

from __future__ import annotations

from typing import Callable, Sequence

from ssd.cluster.runtime import Cluster
from ssd.config import GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine.base import GenerationResult, TokenCallback
from ssd.models import load_tokenizer
from ssd.serve.backend import BackendInfo, TokenizerMixin, backend_info


class ClusterBackend(TokenizerMixin):
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.config = cluster.config
        self.tokenizer = load_tokenizer(self.config.target)  # tokenizing stays in the frontend
        self.info = self._describe()

    def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        generation: GenerationConfig,
        spec: SpeculationConfig,
        on_tokens: TokenCallback | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        return self.cluster.generate(list(prompt_ids), sampling, generation, spec, on_tokens, cancelled)

    def close(self) -> None:
        """The cluster belongs to whoever started it; nothing to free here."""

    def _describe(self) -> BackendInfo:
        remote = self.cluster.describe()
        return backend_info(
            self.config, self.tokenizer, modes=("ar", "ssd") if self.cluster.draft is not None else ("ar",),
            max_context_tokens=remote["max_positions"], eos_token_ids=remote["eos_token_ids"],
        )
