"""Bad settings: every verb rejects them with a one-line error and exit code 2,
before any work, because the settings dataclasses check themselves."""

import os
import subprocess
import sys

import pytest
from tiny_models import build_random_pair

from omnidraft_mlx.bench.run import BenchConfig
from omnidraft_mlx.chat import ChatConfig
from omnidraft_mlx.decode.policy import PolicyConfig
from omnidraft_mlx.decode.speculative import SpecConfig
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.learn.distill import DistillConfig
from omnidraft_mlx.serve.config import ServeConfig
from omnidraft_mlx.settings import check_choice, check_range


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return build_random_pair(tmp_path_factory.mktemp("settings"))


def omnidraft(home, *args):
    env = dict(os.environ, OMNIDRAFT_HOME=str(home))
    return subprocess.run(
        [sys.executable, "-m", "omnidraft_mlx.cli.main", *args], capture_output=True, text=True, env=env, timeout=300
    )


def one_line_error(out) -> str:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--temp", "-1"], ("--temp must be at least 0 (got -1.0)",)),
        (["--top-p", "7"], ("--top-p must be above 0 and at most 1 (got 7.0)",)),
        (["--top-p", "0"], ("--top-p must be above 0 and at most 1 (got 0.0)",)),
        (["--k", "0"], ("--k must be at least 1 (got 0)",)),
        (["--max-tokens", "0"], ("--max-tokens must be at least 1 (got 0)",)),
        (["--translation", "bytes"], ("unknown --translation 'bytes': use text or tokens",)),
        (["--sampling", "greedy"], ("unknown --sampling 'greedy': use exact or omnidraft",)),
        (["--gamma", "1.5"], ("--gamma must be at least 0.0 and at most 1.0 (got 1.5)",)),
        (["--k", "9", "--max-k", "6"], ("--max-k must be at least 9 (got 6)",)),
    ],
)
def test_generate_rejects_bad_settings(pair_dirs, tmp_path, flags, says):
    draft, target = pair_dirs
    line = one_line_error(
        omnidraft(tmp_path, "generate", "--draft", str(draft), "--target", str(target), *flags, "def f(x):")
    )
    assert all(part in line for part in says), line


def test_plain_generate_rejects_bad_temperature(pair_dirs, tmp_path):
    """--model decodes without a drafter: the same settings, the same error."""
    out = omnidraft(tmp_path, "generate", "--model", str(pair_dirs[1]), "--temp", "-1", "def f(x):")
    assert "--temp must be at least 0 (got -1.0)" in one_line_error(out)
    ok = omnidraft(tmp_path, "generate", "--model", str(pair_dirs[1]), "--max-tokens", "4", "--quiet", "def f(x):")
    assert ok.returncode == 0, ok.stderr  # the same command with good settings runs


def test_chat_and_bench_reject_bad_settings(pair_dirs, tmp_path):
    draft, target = (str(p) for p in pair_dirs)
    chat = omnidraft(tmp_path, "chat", "--draft", draft, "--target", target, "--top-p", "7")
    assert "--top-p must be above 0 and at most 1 (got 7.0)" in one_line_error(chat)
    chat = omnidraft(tmp_path, "chat", "--draft", draft, "--target", target, "--sampling", "greedy")
    assert "unknown --sampling 'greedy': use exact or omnidraft" in one_line_error(chat)
    serve = omnidraft(tmp_path, "serve", "--draft", draft, "--target", target, "--translation", "bytes")
    assert "unknown --translation 'bytes': use text or tokens" in one_line_error(serve)
    chat = omnidraft(tmp_path, "chat", "--draft", draft, "--target", target, "--context", "10")
    assert "--context must be at least 64 (got 10)" in one_line_error(chat)
    chat = omnidraft(tmp_path, "chat", "--draft", draft, "--target", target, "--source", "drafter,ngram")
    assert "unknown --source 'ngram': use one of drafter, context, history" in one_line_error(chat)
    serve = omnidraft(tmp_path, "serve", "--draft", draft, "--target", target, "--source", ",")
    assert "--source needs at least one of drafter, context, history" in one_line_error(serve)
    bench = omnidraft(tmp_path, "bench", "--draft", draft, "--target", target, "--k", "0,3")
    assert "--k must be at least 1 (got 0)" in one_line_error(bench)
    bench = omnidraft(tmp_path, "bench", "--draft", draft, "--target", target, "--task", "poetry")
    assert "unknown --task 'poetry': use one of complete, write, math, chat" in one_line_error(bench)


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: SpecConfig(temp=-0.5), "--temp"),
        (lambda: SpecConfig(top_p=1.5), "--top-p"),
        (lambda: SpecConfig(k=0), "--k"),
        (lambda: SpecConfig(max_tokens=0), "--max-tokens"),
        (lambda: ChatConfig(spec=SpecConfig(temp=-1.0)), "--temp"),
        (lambda: ChatConfig(adapt_every=0), "--adapt-every"),
        (lambda: SpecConfig(sources="drafter,lookup"), "--source"),
        (lambda: SpecConfig(sources=()), "--source"),
        (lambda: SpecConfig().for_reply(top_p=0.0), "--top-p"),
        (lambda: PolicyConfig(name="greedy"), "--policy"),
        (lambda: PolicyConfig(name="learned", k=4, max_k=2), "--max-k"),
        (lambda: PolicyConfig(gamma=-0.1), "--gamma"),
        (lambda: PolicyConfig(p_min=1.0), "p_min"),
        (lambda: DistillConfig(lr=0.0), "--lr"),
        (lambda: DistillConfig(lora_rank=-1), "--rank"),
        (lambda: DistillConfig(layers=0), "--layers"),
        (lambda: DistillConfig(batch=0), "--batch"),
        (lambda: BenchConfig(draft="d", target="t", tasks=["complete"], translations=["bytes"]), "--translation"),
        (lambda: BenchConfig(draft="d", target="t", tasks=["complete"], policies=["psychic"]), "--policy"),
        (lambda: BenchConfig(draft="d", target="t", tasks=["complete"], time_limit_s=-60.0), "--time-limit"),
        (lambda: BenchConfig(draft="d", target="t", tasks=["complete"], gammas=[None, 1.5]), "--gamma"),
        (lambda: ServeConfig(draft="d", target="t", batch=0), "--batch"),
        (lambda: ChatConfig(context=63), "--context"),
    ],
)
def test_settings_check_themselves(make, says):
    with pytest.raises(OmniDraftError, match=says) as e:
        make()
    assert "\n" not in str(e.value)


def test_good_settings_pass():
    SpecConfig(k=1, temp=0.0, top_p=1.0, max_tokens=1)
    ChatConfig(context=64)
    PolicyConfig(name="fixed", k=12)  # a fixed length needs no cap
    PolicyConfig(name="learned", gamma=None)
    DistillConfig(lora_rank=0, layers=-1)
    BenchConfig(
        draft="d",
        target="t",
        tasks=["complete", "math", "chat"],
        translations=["text", "tokens"],
        policies=["oracle"],
        gammas=[None, 0.0, 1.0],
    )


def test_settings_are_keyword_only():
    for make in (
        lambda: ServeConfig("d", "t"),
        lambda: BenchConfig("d", "t", ["complete"]),
        lambda: ChatConfig(4),
        lambda: SpecConfig(4),
    ):
        with pytest.raises(TypeError):
            make()


def test_range_and_choice_messages():
    check_range("--x", 0.5, 0.0, 1.0, open_low=True, open_high=True)
    with pytest.raises(OmniDraftError, match=r"^--x must be above 0 and below 1 \(got 1\)$"):
        check_range("--x", 1, 0, 1, open_low=True, open_high=True)
    with pytest.raises(OmniDraftError, match="--x must be at most 3"):
        check_range("--x", float("nan"), high=3)
    with pytest.raises(OmniDraftError, match=r"^unknown --mode 'z': use one of a, b, c$"):
        check_choice("--mode", "z", ("a", "b", "c"))
