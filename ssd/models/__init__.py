"""Model and tokenizer loading: tiny test models, the offline Qwen pair, local dirs, hub ids.

Threads. A loaded model is shared, read-only: any number of threads may run
its forward at once (the server's worker thread drafts with the draft model
while SSD's speculator thread builds its cache with the same model, and
in-process SSD may give one model both roles). Nothing on the forward path
writes to a module: load_model packs every int8 layer before it returns (a
layer built by hand packs on its first forward, under a lock), the int8 fused
projections (quant.py) compute from their arguments alone, FastForward
(fast.py) holds only the model and its shapes, row attention (invariant.py) is a pure function. What holds one sequence's
state has ONE owner thread and is never shared: a KVSequence with its
StaticKV or DynamicCache (kv.py, fast.py), a branch decoder
(ssd.saguaro.branches), an engine, a Speculator (it runs in its serving
thread only). tests/test_threads.py holds the models to this.
"""

from ssd.models.loading import build_tiny_model, load_model
from ssd.models.tokenizer import TinyTokenizer, load_tokenizer
from ssd.models.offline import ModelAssetError

__all__ = ["ModelAssetError", "TinyTokenizer", "build_tiny_model", "load_model", "load_tokenizer"]
