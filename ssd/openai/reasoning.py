"""Reasoning models' thinking, split from their answer: `<think>...</think>` then the answer
(Qwen3, QwQ, DeepSeek-R1), as vLLM's reasoning parsers split it into `reasoning_content`.

Where the output starts is read from the prompt: a prompt that leaves `<think>` open
(DeepSeek-R1's template, Qwen3's with thinking forced) starts in the thinking; a prompt
that closed it (Qwen3's `enable_thinking: false`) or never opened it starts in the answer,
and the model may open it itself. Pure text, no model: the same rules whole and streamed.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


def opened_by(prompt_text: str) -> bool:
    """Whether a prompt's text leaves a `<think>` open, so the output begins in the thinking."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def split(text: str, thinking: bool) -> tuple[str | None, str]:
    """(the reasoning, None where there was no thinking; the answer) of a whole output that
    starts in the thinking or not."""
    stream = ReasoningStream(thinking)
    reasoning, content = stream.finish(text)
    return (reasoning if stream.thought else None), content


@dataclass
class ReasoningStream:
    """Streamed text routed to the reasoning until `</think>`, then to the answer.

    Before any answer text the output may open `<think>` itself (blank lines aside); text that
    could be the start of a marker is held until the next delta shows what it is. After
    `</think>` the answer's leading newlines are dropped; a later `<think>` is the answer's text.
    """

    thinking: bool  # inside the thinking now
    thought: bool = False  # a thinking was seen (the reasoning part exists, maybe empty)
    answering: bool = False  # answer text began
    held: str = ""

    def __post_init__(self) -> None:
        self.thought = self.thinking

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, answer) text that can go out now."""
        self.held += delta
        reasoning = content = ""
        while self.held:
            if self.thinking:
                at = self.held.find(CLOSE)
                if at < 0:
                    keep = _partial(self.held, CLOSE)
                    reasoning += self.held[: len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep:]
                    break
                reasoning += self.held[:at]
                self.held = self.held[at + len(CLOSE):]
                self.thinking = False
            elif self.answering:
                content, self.held = content + self.held, ""
            elif self.thought:  # just past </think>: the answer begins after its newlines
                self.held = self.held.lstrip("\n")
                self.answering = bool(self.held)
            else:  # nothing out yet: the output may open a thinking of its own
                head = self.held.lstrip()
                if head.startswith(OPEN):
                    self.held = head[len(OPEN):]
                    self.thinking = self.thought = True
                elif not head or OPEN.startswith(head):
                    break  # blank, or the start of <think>: wait for more
                else:
                    self.answering = True
        return reasoning, content

    def finish(self, delta: str = "") -> tuple[str, str]:
        """The rest at the end: what was held is text after all."""
        reasoning, content = self.feed(delta)
        rest, self.held = self.held, ""
        return (reasoning + rest, content) if self.thinking else (reasoning, content + rest)


def _partial(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
