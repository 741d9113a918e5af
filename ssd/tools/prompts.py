"""Prompt sets: YAML files of plain (completion) and chat (instruction) prompts.

A file is either a list whose entries are strings (plain) or mappings
{chat: text} / {text: text}, or a mapping {chat: bool, prompts: [...]} whose
flag applies to every string entry. Plain lists stay valid, so older files
and the scripts that read them keep working.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ssd.models.tokenizer import encode_prompt


@dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool = False  # wrap in the chat template when the tokenizer has one

    def encode(self, tokenizer: Any) -> list[int]:
        return encode_prompt(tokenizer, self.text, self.chat)


def load_prompt_set(path: Path, limit: int | None = None) -> list[Prompt]:
    """The prompts of one file (the first `limit` of them)."""
    data = yaml.safe_load(Path(path).read_text())
    chat = False
    if isinstance(data, dict):
        chat = bool(data.get("chat", False))
        data = data.get("prompts")
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty list of prompts")
    prompts = [_entry(item, chat, path) for item in data]
    return prompts[:limit] if limit is not None else prompts


def _entry(item: Any, chat: bool, path: Path) -> Prompt:
    if isinstance(item, str):
        return Prompt(item, chat)
    if isinstance(item, dict) and len(item) == 1:
        (key, text), = item.items()
        if key in ("chat", "text") and isinstance(text, str):
            return Prompt(text, key == "chat")
    raise ValueError(f"{path}: a prompt must be a string, {{chat: text}} or {{text: text}}; got {item!r}")
