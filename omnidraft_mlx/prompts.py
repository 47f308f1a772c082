"""Turning a user prompt into each model's own token ids."""

from __future__ import annotations

from omnidraft_mlx.errors import OmniDraftError


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, messages: list[dict], raw: bool = False) -> list[int]:
    """Token ids of a conversation in this tokenizer's chat template.

    `raw` (or a model without a chat template) sends the messages' text as is.
    """
    if not any(m.get("content") for m in messages):
        raise OmniDraftError("empty prompt: give the model some text to continue")
    if raw or not has_chat_template(tokenizer):
        return list(tokenizer.encode("\n\n".join(m["content"] for m in messages)))
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def user_messages(prompt: str, system: str | None = None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": prompt}]
