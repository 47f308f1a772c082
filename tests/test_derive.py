"""Deriving a shallow drafter: layer selection, distillation, checkpoints, the model directory."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from tiny_models import TEXT, corpus, train_tokenizer, write_model

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.models import derive as d
from omnidraft_mlx.models.pull import local_state, resolve_model

SMALL = dict(seq_len=32, batch=4, select_seqs=2, eval_seqs=4, train_tokens=20_000, lr=1e-3, warmup=5, replies=0)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny 6-layer llama, trained a little, to derive from."""
    tok = train_tokenizer(corpus("draft"), 420)
    return write_model(tmp_path_factory.mktemp("deep") / "deep6", tok, 48, 6, seed=5, train_text=TEXT, train_steps=60)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _windows(tok, n_tokens=4000, length=33):
    return d.token_windows(tok, [TEXT], n_tokens, length, np.random.default_rng(0))


def test_derived_model_keeps_the_chosen_layers_and_loads(deep, home):
    cfg = d.DeriveConfig(
        source=str(deep), layers=3, name="tiny-3l", minutes=0, **{**SMALL, "replies": 2, "reply_tokens": 8}
    )
    out = d.derive(cfg, progress=False)
    info = json.loads((out / "omnidraft.json").read_text())
    assert info["transcripts"] == 2 * len(d.adapt_prompts()) > 0  # the source's chats on code, math, chat
    keep = info["kept_layers"]
    assert len(keep) == 3 and keep == sorted(keep)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3

    src = dict(tree_flatten(load(str(deep))[0].parameters()))
    derived_model, derived_tok = load(str(out))
    got = dict(tree_flatten(derived_model.parameters()))
    for key, value in got.items():
        if key.startswith("model.layers."):
            j, rest = key[len("model.layers.") :].split(".", 1)
            key = f"model.layers.{keep[int(j)]}.{rest}"
        assert mx.array_equal(value, src[key]), key
    assert derived_tok.encode("def add(x):") == load(str(deep))[1].encode("def add(x):")
    # Usable by name, listed as derived.
    assert resolve_model("tiny-3l") == str(out)
    row = next(r for r in local_state() if r["name"] == "tiny-3l")
    assert row["source"] == "derived" and "3 of 6 layers" in row["description"]


def test_transcripts_are_the_sources_chats_and_resume(deep, tmp_path):
    from omnidraft_mlx.prompts import encode_prompt, user_messages

    model, tok = load(str(deep))
    prompts = {"code": ["def add(a, b):", "class Stack:"], "chat": ["Say hello to the farmer."]}
    path = tmp_path / "chats.jsonl"
    chats = d.transcripts(model, tok, prompts, 3, 8, path, batch=4)
    asked = [
        "def add(a, b):",
        "Say hello to the farmer.",
        "class Stack:",
        "Say hello to the farmer.",
        "def add(a, b):",
        "Say hello to the farmer.",
    ]  # tasks take turns
    assert len(chats) == 6
    for chat, prompt in zip(chats, asked):
        start = tok.decode(encode_prompt(tok, user_messages(prompt)))
        assert chat.startswith(start) and len(chat) > len(start)  # the prompt, then a reply
    # Interrupted after the first batch: a rerun generates only the rest.
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:4]))
    again = d.transcripts(model, tok, prompts, 3, 8, path, batch=4)
    assert again[:4] == chats[:4] and len(again) == 6
    assert d.transcripts(None, tok, prompts, 3, 8, path) == again  # all there: no model needed


def test_selection_drops_the_cheapest_layer_first(deep):
    model, tok = load(str(deep))
    windows = _windows(tok)[:2]
    result = d.select_layers(model, windows, 5)
    x, y = mx.array(windows[:, :-1]), mx.array(windows[:, 1:])
    full = list(model.model.layers)
    losses = []
    for drop in range(6):
        d.keep_layers(model, [i for i in range(6) if i != drop], full)
        losses.append(d._ce(model(x), y).item())
    d.keep_layers(model, list(range(6)), full)
    assert result["order"] == [int(np.argmin(losses))]
    assert result["loss"][1] == pytest.approx(min(losses), rel=1e-4)
    # Continuing a shorter result gives the same order as one run.
    assert d.select_layers(model, windows, 3, done=result)["order"] == d.select_layers(model, windows, 3)["order"]


def _student(deep, keep):
    student, _ = load(str(deep))
    d.keep_layers(student, keep, list(student.model.layers))
    return student


def test_distillation_lowers_the_kl(deep, tmp_path):
    teacher, tok = load(str(deep))
    student = _student(deep, [0, 5])
    train, heldout = _windows(tok), _windows(tok, 600)
    before = d.heldout_losses(student, teacher, heldout, 4)["kl"]
    cfg = d.DeriveConfig(minutes=5, steps=25, **SMALL)
    meta = d.distill(student, teacher, train, cfg, tmp_path / "ckpt.safetensors", {"source": "x", "keep": [0, 5]})
    assert meta["step"] == 25
    assert d.heldout_losses(student, teacher, heldout, 4)["kl"] < 0.7 * before


class _KillAfter:
    """A progress display that interrupts the run after n steps, as Ctrl-C would."""

    def __init__(self, n):
        self.n = n

    def add_task(self, *args, **kwargs):
        return 0

    def update(self, *args, **kwargs):
        self.n -= 1
        if self.n < 0:
            raise KeyboardInterrupt


def test_resume_continues_the_step_count(deep, tmp_path):
    teacher, tok = load(str(deep))
    train, meta = _windows(tok), {"source": "x", "keep": [1, 4]}
    cfg = d.DeriveConfig(steps=6, checkpoint_every=0, **SMALL)
    ckpt = tmp_path / "ckpt.safetensors"
    with pytest.raises(KeyboardInterrupt):
        d.distill(_student(deep, [1, 4]), teacher, train, cfg, ckpt, meta, progress=_KillAfter(3))
    resumed = _student(deep, [1, 4])
    again = d.distill(resumed, teacher, train, cfg, ckpt, meta, progress=_KillAfter(3))
    assert again["step"] == 6
    straight = _student(deep, [1, 4])
    d.distill(straight, teacher, train, cfg, tmp_path / "other.safetensors", meta)
    for (k, a), (_, b) in zip(tree_flatten(resumed.parameters()), tree_flatten(straight.parameters())):
        assert mx.allclose(a, b, atol=1e-5), k
    with pytest.raises(OmniDraftError, match="--restart"):
        d.distill(_student(deep, [0, 5]), teacher, train, cfg, ckpt, {"source": "x", "keep": [0, 5]})


@pytest.mark.parametrize(
    "source, layers, match",
    [
        ("deep", 6, "between 1 and 5"),
        ("deep", 0, "between 1 and 5"),
        ("no-such-model", 2, "unknown model"),
    ],
)
def test_bad_input_is_one_line(deep, home, source, layers, match):
    cfg = d.DeriveConfig(source=str(deep) if source == "deep" else source, layers=layers, minutes=0, **SMALL)
    with pytest.raises(OmniDraftError, match=match) as err:
        d.derive(cfg, progress=False)
    assert "\n" not in str(err.value)
