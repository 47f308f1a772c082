"""`omnidraft chat` driven as a person would: in a pseudo-terminal, on the tiny models."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pexpect
import pytest

from omnidraft_mlx.chat import Conversation
from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.prompts import encode_prompt

PROMPT = "you> "
FOOTER = r"(\d+) tokens, [\d.]+ tok/s \| acceptance [\d.]+ \| [\d.]+ tokens/target forward"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def spawn(tiny_dirs, home, *args, preexec_fn=None) -> pexpect.spawn:
    env = dict(os.environ, OMNIDRAFT_HOME=str(home), TERM="xterm")
    argv = [
        "-m",
        "omnidraft_mlx.cli.main",
        "chat",
        "--draft",
        str(tiny_dirs["draft"]),
        "--target",
        str(tiny_dirs["target"]),
        *args,
    ]
    child = pexpect.spawn(
        sys.executable, argv, env=env, encoding="utf-8", timeout=120, dimensions=(50, 200), preexec_fn=preexec_fn
    )
    child.expect("drafting for")
    child.expect(PROMPT)
    return child


def clean(text: str) -> str:
    return ANSI.sub("", text).replace("\r\n", "\n")


def say(child, message: str) -> str:
    """Send one message; the streamed reply as the terminal showed it."""
    child.sendline(message)
    child.expect_exact(message.splitlines()[-1] + "\r\n")  # readline's echo
    child.expect(FOOTER)
    reply = clean(child.before)
    child.expect(PROMPT)
    return re.sub(r"\n\(stopped at --max-tokens \d+\)\n$", "", reply).removesuffix("\n")


def command(child, line: str) -> str:
    child.sendline(line)
    child.expect_exact(line + "\r\n")
    child.expect(PROMPT)
    return clean(child.before)


def greedy_text(model, tok, messages, max_tokens: int) -> str:
    """The target's own greedy reply to the conversation, without any drafter."""
    ids = plain_generate(model, tok, encode_prompt(tok, messages), PlainStats(), max_tokens=max_tokens)
    return tok.decode(list(ids))


def test_conversation_and_commands(tiny, tiny_dirs, tmp_path):
    model, tok = tiny["target"]
    chat = spawn(tiny_dirs, tmp_path / "home", "--max-tokens", "24")
    first = say(chat, "def add_3(x):")
    messages = [{"role": "user", "content": "def add_3(x):"}]
    assert first == greedy_text(model, tok, messages, 24)  # greedy: exactly the target's text
    # The second turn sees the whole conversation, in the target's template.
    second = say(chat, "print(add_")
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "print(add_"}]
    assert second == greedy_text(model, tok, messages, 24)

    stats = command(chat, "/stats")
    assert "replies 2, 48 tokens" in stats and "conversation 4 messages, 4 sent" in stats
    # The estimate is report.speedup over the replies: a median with its range.
    assert re.search(r"estimated speedup ~[\d.]+x \(median of 2 replies, [\d.]+-[\d.]+x\)", stats)
    saved = tmp_path / "conversation.json"
    assert "saved 4 messages" in command(chat, f"/save {saved}")
    assert json.loads(saved.read_text())["messages"] == messages + [{"role": "assistant", "content": second}]
    assert "new conversation" in command(chat, "/reset")
    assert "conversation 0 messages" in command(chat, "/stats")
    assert "loaded 4 messages" in command(chat, f"/load {saved}")
    assert "conversation 4 messages" in command(chat, "/stats")
    assert "error: no such file" in command(chat, f"/load {tmp_path / 'missing.json'}")
    assert "unknown command /frobnicate" in command(chat, "/frobnicate")
    assert "/adapt on|off" in command(chat, "/help")
    assert "drafter learning off" in command(chat, "/adapt off")
    chat.sendline("/quit")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0

    # What the pair learned was saved; the next session starts with it.
    profile = next((tmp_path / "home" / "profiles").glob("*/ngrams-*.json"))
    entries = len(json.loads(profile.read_text())["entries"])
    assert entries > 0
    again = spawn(tiny_dirs, tmp_path / "home")
    assert f"n-gram cache {entries}" in clean(again.before)
    again.sendeof()
    again.expect(pexpect.EOF)


def endless_target(tiny_dirs, tmp_path) -> dict:
    """The tiny target with its end of sequence moved to a token it never writes,
    so a reply runs until it is interrupted (a tiny model may otherwise stop at once)."""
    target = tmp_path / "endless-target"
    shutil.copytree(tiny_dirs["target"], target)
    for name, key, value in [
        ("config.json", "eos_token_id", None),
        ("tokenizer_config.json", "eos_token", "<|endoftext|>"),
    ]:
        cfg = json.loads((target / name).read_text())
        tok = json.loads((target / "tokenizer.json").read_text())
        eos_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|endoftext|>")
        cfg[key] = value or eos_id
        (target / name).write_text(json.dumps(cfg))
    return {**tiny_dirs, "target": target}


def test_ctrl_c_stops_reply_and_ctrl_d_exits(tiny_dirs, tmp_path):
    # Fixed k: once the learned head decides, drafting runs far ahead and a tiny pair can fill the
    # context before the interrupt lands.
    # Started with SIGINT ignored, as a background job of a script (CI's, say) starts its children.
    chat = spawn(
        endless_target(tiny_dirs, tmp_path),
        tmp_path / "home",
        "--max-tokens",
        "100000",
        "--policy",
        "fixed",
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    chat.sendline("def add_3(x):")
    chat.expect("return")  # streaming has begun
    chat.sendintr()
    chat.expect_exact("(interrupted)")
    chat.expect(FOOTER)
    chat.expect(PROMPT)
    # Ctrl-C at the prompt keeps the session too.
    chat.sendintr()
    chat.expect_exact("Ctrl-D or /quit leaves")
    chat.expect(PROMPT)
    saved = tmp_path / "c.json"
    command(chat, f"/save {saved}")
    roles = [(m["role"], m["content"]) for m in json.loads(saved.read_text())["messages"]]
    assert roles[0] == ("user", "def add_3(x):")
    assert roles[1][0] == "assistant" and "return" in roles[1][1]  # the partial reply is kept
    chat.sendeof()
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_multiline_input_and_trimming(tiny_dirs, tmp_path):
    chat = spawn(tiny_dirs, tmp_path / "home", "--max-tokens", "12", "--context", "96", "--system", "Be brief.")
    chat.sendline("def add_1(x):\\")
    say(chat, "    return x + 1")
    chat.sendline('"""')
    chat.sendline("print(add_1(3))")
    chat.sendline("print(add_2(6))")
    say(chat, '"""')
    saved = tmp_path / "c.json"
    command(chat, f"/save {saved}")
    messages = json.loads(saved.read_text())["messages"]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert [m["content"] for m in messages if m["role"] == "user"] == [
        "def add_1(x):\n    return x + 1",
        "print(add_1(3))\nprint(add_2(6))",
    ]
    # Each exchange takes ~30 of the 96 tokens: older ones must go, and the chat says so.
    shown = "".join(say(chat, f"def add_{i}(x):") for i in range(3, 7))
    assert "oldest messages are no longer sent to the models" in shown
    stats = command(chat, "/stats")
    total, sent = map(int, re.search(r"conversation (\d+) messages, (\d+) sent", stats).groups())
    assert total == 12 and sent < total
    chat.sendline("/quit")
    chat.expect(pexpect.EOF)


def test_drafter_learns_between_turns_and_next_session_starts_with_it(tiny_dirs, tmp_path):
    home = tmp_path / "home"
    chat = spawn(tiny_dirs, home, "--max-tokens", "12", "--adapt-every", "1", "--policy", "learned")
    chat.sendline("def add_3(x):")
    chat.expect(FOOTER)
    chat.expect(r"drafter update 1: loss [\d.]+")
    chat.expect(PROMPT)
    assert "paused" not in command(chat, "/stats")
    assert "drafter learning off" in command(chat, "/adapt off")
    say(chat, "print(add_")
    stats = command(chat, "/stats")
    assert "drafter learning paused: 1 updates so far, 0/1 replies gathered" in stats
    chat.sendeof()
    chat.expect(pexpect.EOF)
    manifest = json.loads(next((home / "profiles").glob("*/manifest.json")).read_text())
    assert manifest["updates"] == 1
    assert next((home / "profiles").glob("*/accept_head-*.npz")).stat().st_size > 0  # the draft-length head learned too
    again = spawn(tiny_dirs, home, "--no-adapt")
    assert "drafter updates 1" in clean(again.before)
    assert "started with --no-adapt" in command(again, "/adapt on")
    again.sendeof()
    again.expect(pexpect.EOF)


def test_too_long_message_is_refused_not_fatal(tiny_dirs, tmp_path):
    chat = spawn(tiny_dirs, tmp_path / "home", "--max-tokens", "8", "--context", "64")
    chat.sendline("print(add_1(3)) " * 30)
    chat.expect_exact("this message is too long for the context")
    chat.expect(PROMPT)
    assert "conversation 0 messages" in command(chat, "/stats")
    chat.sendeof()
    chat.expect(pexpect.EOF)


def test_bad_options_one_line_error(tmp_path):
    env = dict(os.environ, OMNIDRAFT_HOME=str(tmp_path))
    for bad in (["--k", "0"], ["--policy", "longest"]):
        out = subprocess.run(
            [sys.executable, "-m", "omnidraft_mlx.cli.main", "chat", *bad],
            capture_output=True,
            text=True,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        assert out.returncode == 2
        assert out.stderr.strip().startswith("error:") and "Traceback" not in out.stderr


@pytest.mark.parametrize("content", ["not json", '{"messages": [{"role": "robot", "content": "hi"}]}', "[1, 2]"])
def test_load_rejects_what_is_not_a_conversation(tmp_path, content):
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(OmniDraftError):
        Conversation.load(path)


def test_load_accepts_a_bare_message_list(tmp_path):
    path = tmp_path / "c.json"
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    path.write_text(json.dumps(messages))
    conv = Conversation.load(path)
    assert conv.system == "S" and conv.all_messages() == messages
