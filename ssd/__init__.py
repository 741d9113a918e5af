"""ssd: exact, asynchronous speculative speculative decoding (Saguaro)."""

__version__ = "0.1.0"
