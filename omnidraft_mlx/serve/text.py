"""A reply's text as it streams: cut at the request's stop strings, split into content and tool calls.

Text arrives a round at a time, and a stop string or a tool call's opening
marker may straddle two rounds, so whatever could begin one is held back until
the next round settles it. A tool call's text is held whole until its closing
marker (or the reply's end), then parsed (tools.parse_calls); text that
does not parse goes out as content, markers and all. With tool_choice "auto", a
reply that may still be nothing but JSON calls (tools.json_calls) is held
whole, and so is a ``` block after text: as calls at the reply's end, or let go
as soon as it cannot be one.
"""

from __future__ import annotations

from omnidraft_mlx.serve.tools import fence_opens, json_calls, may_be_json_calls, parse_calls
from omnidraft_mlx.vocab.textstream import TextStream


class Marker:
    """A string looked for in text that comes a character at a time (Knuth-Morris-Pratt): a state is
    how many of the marker's first characters the text so far ends with; each character costs O(1)
    amortized, so the text held back for a marker costs no more than the text itself."""

    def __init__(self, text: str):
        self.text, self.back = text, [0] * len(text)  # back[i]: the state to fall back to after text[: i + 1]
        state = 0
        for i in range(1, len(text)):
            self.back[i] = state = self.step(state, text[i])

    def step(self, state: int, c: str) -> int:
        """The state after one more character `c`; len(text) once the marker is complete."""
        while state and (state == len(self.text) or self.text[state] != c):
            state = self.back[state - 1]
        return state + (self.text[state] == c)

    def held_back(self, text: str) -> int:
        """How many characters at the end of `text` (holding no whole marker) could begin the marker."""
        state = 0
        for c in text[max(0, len(text) - len(self.text) + 1) :]:
            state = self.step(state, c)
        return state


class StopText:
    """Streamed text cut at the first stop string to end; text that may begin one is held back."""

    def __init__(self, stops: list[str]):
        self.stops, self.states, self.pending = [Marker(s) for s in stops], [0] * len(stops), ""
        self.reached: str | None = None  # the stop string that ended the text

    def add(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was reached)."""
        start, self.pending = len(self.pending), self.pending + text
        for i in range(start, len(self.pending)):
            for j, stop in enumerate(self.stops):
                self.states[j] = stop.step(self.states[j], self.pending[i])
                if self.states[j] == len(stop.text):
                    out, self.pending, self.reached = self.pending[: i + 1 - len(stop.text)], "", stop.text
                    return out, True
        cut = len(self.pending) - max(self.states, default=0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class PlainText:
    """Streamed text -> events ("text", str): a reply with no tool calls to find. The interface of
    the splitters below: add(text) -> the events it settles; finish() -> the rest, at the reply's end."""

    def add(self, text: str) -> list[tuple[str, object]]:
        return [("text", text)] if text else []

    def finish(self) -> list[tuple[str, object]]:
        return []


class ToolSplit:
    """Streamed text -> events ("text", str) and ("tool_calls", [call, ...]), in order.

    `fmt` is the target's tool-call format (tools.ToolFormat); `opened`: the
    reply starts inside a call, whose start marker and this text were put in the prompt.
    """

    def __init__(self, fmt, opened: str | None = None):
        self.fmt, self.inside, self.pending = fmt, opened is not None, opened or ""
        self.start = Marker(fmt.start)

    def add(self, text: str) -> list[tuple[str, object]]:
        self.pending += text
        events, start, end = [], self.fmt.start, self.fmt.end
        while True:
            if not self.inside:
                i = self.pending.find(start)
                if i < 0:
                    cut = len(self.pending) - self.start.held_back(self.pending)
                    events.append(("text", self.pending[:cut]))
                    self.pending = self.pending[cut:]
                    break
                events.append(("text", self.pending[:i]))
                self.pending, self.inside = self.pending[i + len(start) :], True
            else:
                j = self.pending.find(end)
                if j < 0:
                    break
                body, self.pending, self.inside = self.pending[:j], self.pending[j + len(end) :], False
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


class JsonCalls:
    """A reply that ends in JSON calls of the offered `tools` (tools.json_calls): the whole
    reply, or a ``` block on lines of its own after text -> the text, then one ("tool_calls",
    [call, ...]) event at the reply's end. Text goes on through `then`, another splitter, as soon as
    it shows that it cannot be part of such an ending."""

    def __init__(self, tools: list[dict], then):
        self.tools, self.then = tools, then
        self.held, self.fenced = "", False  # held from the reply's start, or (fenced) from a line break

    def add(self, text: str) -> list[tuple[str, object]]:
        self.held += text
        events = []
        while self.held and not self.may_be_calls():
            cut = next((i for i in line_breaks(self.held) if fence_opens(self.held[i:])), len(self.held))
            events += self.then.add(self.held[:cut])
            self.held, self.fenced = self.held[cut:], True
        return events

    def may_be_calls(self) -> bool:
        block_starts = not self.fenced or self.held.startswith("\n")  # not inside a line of text
        return block_starts and may_be_json_calls(self.held, self.tools, self.fenced)

    def finish(self) -> list[tuple[str, object]]:
        calls = self.may_be_calls() and json_calls(self.held, self.tools, self.fenced)
        held, self.held = self.held, ""
        if calls:
            return self.then.finish() + [("tool_calls", calls)]
        return self.then.add(held) + self.then.finish()


def line_breaks(text: str):
    """Where `text` breaks a line, its first character aside (held text may start at a break)."""
    return (i for i in range(1, len(text)) if text[i] == "\n")


def splitter(tools):
    """The splitter of a reply to a request with this tools.ToolPlan."""
    split = ToolSplit(tools.fmt, tools.opened) if tools.fmt else PlainText()
    return JsonCalls(tools.tools, split) if tools.bare else split


class ReplyText:
    """A reply's target ids -> its events: text (from the tokens' bytes), cut at the stop strings,
    split into content and tool calls when the request offers tools (tools.ToolPlan)."""

    def __init__(self, target_bytes: list[bytes | None], stops: list[str], tools, emit):
        self.text, self.stop, self.emit, self.called = TextStream(target_bytes), StopText(stops), emit, False
        self.split = splitter(tools)

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
        for kind, payload in self.split.add(piece) + (self.split.finish() if last else []):
            if payload:
                self.called |= kind == "tool_calls"
                self.emit(kind, payload)
