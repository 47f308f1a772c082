"""Streaming target tokens as text."""

from __future__ import annotations

import codecs


class TextStream:
    """Target ids -> text, from the tokens' own bytes: a piece that ends inside
    a UTF-8 character waits for the rest, and no leading space is lost."""

    def __init__(self, target_bytes: list[bytes | None]):
        self.target_bytes = target_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self.decoder.decode(self.target_bytes[token] or b"")

    def finish(self) -> str:
        return self.decoder.decode(b"", final=True)
