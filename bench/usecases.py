"""Benchmark tasks where the answer is largely on screen already, built from
the held-out splits (never the adaptation split), and the user's own prompts.

- edit: a held-out HumanEval solution given in full with a change to make
  (rename, type hints, comments, a new case...); replies repeat most of the code.
- multiturn: 3-turn conversations over held-out code, math and chat prompts whose
  later turns build on the earlier replies (the target's own greedy replies);
  turns 2 and 3 are measured.
- a JSONL file of the user's prompts: {"prompt": "..."} or {"messages": [...]}
  (a trailing assistant message, a reference answer, is dropped).
"""

from __future__ import annotations

import re
from pathlib import Path

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.serve.tools import ToolPlan, encode
from omnidraft_mlx.tasks import Prompt, load_task

USE_CASES = ("edit", "multiturn")
EDITS = (
    "Rename the function `{name}` to `{name}_v2` and show the whole updated code.",
    "Add type hints to every parameter and to the return value, and show the whole updated code.",
    "Add a short comment above each line of the function body, and show the whole updated code.",
    "Make the function raise a ValueError when its first argument is None, and show the whole updated code.",
    "Replace the docstring with a one-line summary, keep the code as it is, and show the whole updated code.",
)
FOLLOW_UPS = {
    "complete": (
        "Now add a docstring and type hints to your function and show the whole code again.",
        "Now write three assert-based tests for that function.",
    ),
    "math": (
        "Check your answer: go through your solution again, step by step.",
        "Now solve the same problem with every number in it doubled.",
    ),
    "chat": ("Make that shorter, keeping the main points in the same order.", "Now turn it into a bulleted list."),
}


def edit_prompts(n: int) -> list[Prompt]:
    prompts = []
    for i, p in enumerate(load_task("complete", "heldout")[:n]):
        code = p.reference.removeprefix("```python\n").removesuffix("```")
        name = re.findall(r"^def (\w+)\(", code, re.M)[-1]
        change = EDITS[i % len(EDITS)].format(name=name)
        prompts.append(Prompt(f"edit/{p.id}", "edit", f"Here is a Python function:\n```python\n{code}```\n{change}"))
    return prompts


def prompt_ids(pair, prompt: Prompt) -> tuple[list[int], list[int]]:
    """(draft ids, target ids) of a prompt, encoded as the server encodes a request (with its tools)."""
    return encode(pair, prompt.messages(), False, ToolPlan(list(prompt.tools) or None))


def greedy_reply(pair, prompt: Prompt, max_tokens: int) -> str:
    """The target's greedy reply: what later turns of a scripted conversation build on.
    Decoded here, untimed, by the speculative loop: greedy, its output is the target's own
    (sooner than plain decoding, which a run times on the turns it measures)."""
    from omnidraft_mlx.decode.speculative import SpecConfig, SpecStats, speculative_generate

    cfg = SpecConfig(max_tokens=max_tokens)
    return pair.target_tok.decode(
        [t for new, _ in speculative_generate(pair, *prompt_ids(pair, prompt), cfg, SpecStats()) for t in new]
    )


def multiturn_prompts(n: int, pair, max_tokens: int, replied=lambda what: None) -> list[Prompt]:
    """n prompts: turns 2 and 3 of n/2 conversations (the tasks taken in turn); the
    earlier replies are the target's own greedy replies (decoded here, untimed; replied(id)
    after each of the 2 a conversation)."""
    firsts = [p for group in zip(*(load_task(t, "heldout") for t in FOLLOW_UPS)) for p in group][: (n + 1) // 2]
    prompts = []
    for first in firsts:
        context: list[dict] = []
        for turn, text in enumerate((first.text, *FOLLOW_UPS[first.task]), 1):
            if turn > 1:
                prompts.append(Prompt(f"multiturn/{first.id}/{turn}", "multiturn", text, context=tuple(context)))
            if turn < 3:
                reply = greedy_reply(pair, Prompt(first.id, first.task, text, context=tuple(context)), max_tokens)
                context += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
                replied(f"multiturn/{first.id}/{turn}")
    return prompts[:n]


def file_prompts(path: str | Path) -> list[Prompt]:
    """The user's prompts (JSONL), task "file"."""
    from omnidraft_mlx.learn.adapt import read_jsonl

    prompts = []
    for i, sample in enumerate(read_jsonl(Path(path).expanduser())):
        messages = sample.messages[:-1] if sample.messages[-1]["role"] == "assistant" else sample.messages
        if not messages or messages[-1]["role"] != "user":
            raise OmniDraftError(f"{path}: prompt {i + 1} does not end with a user message")
        prompts.append(Prompt(f"file/{i + 1}", "file", messages[-1]["content"], context=tuple(messages[:-1])))
    if not prompts:
        raise OmniDraftError(f'{path} holds no prompts: one JSON object per line, {{"prompt": "..."}}')
    return prompts
