"""One generation with the configured pair; prints the text and the stats.

    ssd generate                       # default config, SD
    ssd generate "def add(a, b):" --mode ar --max-new-tokens 32
    ssd generate --config configs/tiny.yaml

`python launch/generate.py` takes the same flags.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from ssd.app.cli import add_config_args, config_from_args
from ssd.factory import build_engine
from ssd.engine.request import GenerationRequest
from ssd.models.tokenizer import Tokenizer, encode_prompt


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", help="prompt text (default: the config's prompt)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--stream", action="store_true", help="print tokens as each round lands")
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)

    engine = build_engine(config)
    prompt_ids = encode_prompt(engine.tokenizer, args.prompt or config.prompt, args.chat)
    on_tokens = _streamer(engine.tokenizer) if args.stream else None
    try:
        result = engine.generate(GenerationRequest(prompt_ids, config.sampling, config.generation, on_tokens=on_tokens))
    finally:
        engine.close()
    if args.stream:
        print()
    else:
        print(result.text)
    print(f"--- finish: {result.finish_reason}; {result.stats.summary()}", file=sys.stderr)


def _streamer(tokenizer: Tokenizer) -> Callable[[list[int]], None]:
    """Print the text delta of each round (decoding the whole output keeps UTF-8 intact)."""
    ids: list[int] = []
    shown = 0

    def on_tokens(new: list[int]) -> None:
        nonlocal shown
        ids.extend(new)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[shown:], end="", flush=True)
            shown = len(text)

    return on_tokens

