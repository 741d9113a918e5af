"""Model and tokenizer loading: tiny test models, the offline Qwen pair, local dirs, hub ids."""

from ssd.models.loading import build_tiny_model, load_model
from ssd.models.tokenizer import TinyTokenizer, load_tokenizer
from ssd.models.offline import ModelAssetError

__all__ = ["ModelAssetError", "TinyTokenizer", "build_tiny_model", "load_model", "load_tokenizer"]
