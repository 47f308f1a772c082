"""A reply's text as it streams: cut at the request's stop strings, split into content and tool calls.

Text arrives a round at a time, and a stop string or a tool call's opening
marker may straddle two rounds, so whatever could begin one is held back until
the next round settles it. A tool call's text is held whole until its closing
marker (or the reply's end), then parsed (serve_tools.parse_calls); text that
does not parse goes out as content, markers and all.
"""

from __future__ import annotations

from omnidraft_mlx.serve_tools import parse_calls
from omnidraft_mlx.textstream import TextStream


def held_back(text: str, markers: list[str]) -> int:
    """How many characters at the end of `text` could begin one of the markers."""
    return max((n for s in markers for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


class StopText:
    """Streamed text cut at the first stop string; text that may begin one is held back."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending = stops, ""

    def add(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was reached)."""
        self.pending += text
        hits = [i for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        cut = len(self.pending) - held_back(self.pending, self.stops)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class ToolSplit:
    """Streamed text -> events ("text", str) and ("tool_calls", [call, ...]), in order.

    `fmt` is the target's tool-call format (serve_tools.ToolFormat); `opened`: the
    reply starts inside a call, whose start marker and this text were put in the prompt.
    """

    def __init__(self, fmt, opened: str | None = None):
        self.fmt, self.inside, self.pending = fmt, opened is not None, opened or ""

    def add(self, text: str) -> list[tuple[str, object]]:
        self.pending += text
        events, start, end = [], self.fmt.start, self.fmt.end
        while True:
            if not self.inside:
                i = self.pending.find(start)
                if i < 0:
                    cut = len(self.pending) - held_back(self.pending, [start])
                    events.append(("text", self.pending[:cut]))
                    self.pending = self.pending[cut:]
                    break
                events.append(("text", self.pending[:i]))
                self.pending, self.inside = self.pending[i + len(start):], True
            else:
                j = self.pending.find(end)
                if j < 0:
                    break
                body, self.pending, self.inside = self.pending[:j], self.pending[j + len(end):], False
                calls = parse_calls(self.fmt, body)
                events.append(("tool_calls", calls) if calls else ("text", start + body + end))
        return [e for e in events if e[1]]

    def finish(self) -> list[tuple[str, object]]:
        """The reply ended: a call left open is its longest run of whole lines that parses, the
        rest text (a small model may write on past its call without closing it)."""
        rest, self.pending = self.pending, ""
        if not self.inside:
            return [("text", rest)] if rest else []
        self.inside, lines = False, rest.split("\n")
        for n in range(len(lines), 0, -1):
            if calls := parse_calls(self.fmt, "\n".join(lines[:n])):
                return [("tool_calls", calls)] + [("text", "\n" + "\n".join(lines[n:]))] * (n < len(lines))
        return [("text", self.fmt.start + rest)]


class ReplyText:
    """A reply's target ids -> its events: text (from the tokens' bytes), cut at the stop strings,
    split into content and tool calls when the request has a tool format (serve_tools.ToolPlan)."""

    def __init__(self, target_bytes: list[bytes | None], stops: list[str], tools, emit):
        self.text, self.stop, self.emit, self.called = TextStream(target_bytes), StopText(stops), emit, False
        self.tools = ToolSplit(tools.fmt, tools.opened) if tools.fmt else None

    def add(self, ids: list[int]) -> bool:
        """Send what these ids settle; whether a stop string was reached (the reply ends there)."""
        piece, stopped = self.stop.add("".join(self.text.add(t) for t in ids))
        self._send(piece, last=stopped)
        return stopped

    def finish(self) -> None:
        """The reply ended by itself: send what was held back."""
        piece, stopped = self.stop.add(self.text.finish())
        self._send(piece + ("" if stopped else self.stop.flush()), last=True)

    def _send(self, piece: str, last: bool) -> None:
        if self.tools is None:
            events = [("text", piece)]
        else:
            events = self.tools.add(piece) + (self.tools.finish() if last else [])
        for kind, payload in events:
            if payload:
                self.called |= kind == "tool_calls"
                self.emit(kind, payload)
