"""Conversations in TRL's form, shared by the data, the rewards and the experience: a leaf that imports nothing of the
package."""

from __future__ import annotations

from typing import Any


def is_conversation(value: Any) -> bool:
    """Whether ``value`` is a conversation in TRL's form: a non-empty list of ``{"role", "content"}`` messages."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def completion_like(prompt: Any, text: str) -> Any:
    """A completion in its prompt's form, as TRL hands it to reward functions: ``text`` for a string prompt;
    ``[{"role": "assistant", "content": text}]`` for a conversation (after the assistant's begun message, if the
    prompt ends with one)."""
    if not is_conversation(prompt):
        return text
    begun = prompt[-1]["content"] if prompt[-1]["role"] == "assistant" else ""
    return [{"role": "assistant", "content": begun + text}]
