"""Tiny randomly initialised models with real, partly overlapping tokenizers.

Two byte-level BPE tokenizers trained on different text with different
vocabulary sizes: they share some tokens, merge others differently, and each
has tokens the other lacks, like a real cross-vocabulary pair.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text, llama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# What both tiny models learn: short, regular Python, so they agree often.
TEXT = "\n".join(
    f"def add_{i}(x):\n    return x + {i}\n\nprint(add_{i}({i * 3}))  # {w}\n"
    for i, w in zip(range(60), ["one", "two", "three", "four", "five", "six"] * 10)
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus(which: str) -> list[str]:
    """Text to train a tokenizer on: Python's own sources, two disjoint sets."""
    import argparse  # noqa: E401
    import collections
    import dataclasses
    import json as json_mod
    import textwrap
    import typing

    mods = [argparse, collections, dataclasses] if which == "draft" else [json_mod, textwrap, typing]
    texts = []
    for mod in mods:
        path = Path(mod.__file__)
        if path.name == "__init__.py":
            path = path.parent / "__init__.py"
        texts.append(path.read_text())
    return texts + ["Ünïcödé façade naïve 日本語 テキスト 🙂 emoji"]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def write_model(
    out: Path,
    tok: Tokenizer,
    hidden: int,
    layers: int,
    seed: int,
    logit_scale: float = 1.0,
    train_text: str = "",
    train_steps: int = 0,
    window: int = 0,
) -> Path:
    """A tiny llama with random weights, as an mlx-lm model directory; with
    window > 0 a tiny Gemma 3 instead (sliding-window layers, every third global)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 2048,
            }
        )
    )
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": tok.get_vocab_size(),
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "eos_token_id": tok.token_to_id("<|im_end|>"),
    }
    arch = llama
    if window:
        arch = gemma3_text
        config.update(
            model_type="gemma3_text",
            head_dim=hidden // 4,
            query_pre_attn_scalar=hidden // 4,
            sliding_window=window,
            sliding_window_pattern=3,
        )
    (out / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # A sharper output layer than the default init: peaked next-token
    # distributions, like a trained model's, so sampled sequences repeat.
    model.lm_head.weight = model.lm_head.weight * logit_scale
    if train_text:
        train_lm(model, tok, train_text, steps=train_steps)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


def train_lm(model, tok: Tokenizer, text: str, steps: int, seq: int = 64, batch: int = 16) -> None:
    """A few hundred AdamW steps of next-token prediction: both tiny models
    learn the same text, so they agree often, as a real drafter and target do."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    ids = np.array(tok.encode(text).ids)
    rng = np.random.default_rng(0)
    opt = optim.AdamW(learning_rate=3e-3)

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y).mean()

    step = nn.value_and_grad(model, loss_fn)
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - seq - 1, batch)
        x = mx.array(np.stack([ids[s : s + seq] for s in starts]))
        y = mx.array(np.stack([ids[s + 1 : s + seq + 1] for s in starts]))
        loss, grads = step(model, x, y)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)


def build_tiny_models(root: Path, steps: int = 300) -> dict[str, Path]:
    """Model dirs: "draft" and "target" (different tokenizers: the target's is
    bigger and trained on other text) and "same" (a drafter with the target's tokenizer)."""
    draft_tok = train_tokenizer(corpus("draft"), 420)
    target_tok = train_tokenizer(corpus("target"), 600)
    return {
        "draft": write_model(root / "tiny-draft", draft_tok, 48, 2, seed=1, train_text=TEXT, train_steps=steps),
        "target": write_model(root / "tiny-target", target_tok, 64, 2, seed=2, train_text=TEXT, train_steps=steps),
        "same": write_model(root / "tiny-same", target_tok, 48, 2, seed=3, train_text=TEXT, train_steps=steps),
    }


def build_random_pair(root: Path) -> tuple[Path, Path]:
    """Untrained models with sharp output layers: peaked, unrelated distributions."""
    draft = write_model(root / "rand-draft", train_tokenizer(corpus("draft"), 420), 48, 2, seed=3, logit_scale=30.0)
    target = write_model(root / "rand-target", train_tokenizer(corpus("target"), 600), 64, 2, seed=4, logit_scale=30.0)
    return draft, target


def build_windowed_models(root: Path, window: int, steps: int = 300) -> dict[str, Path]:
    """Tiny Gemma 3 models with a small sliding window, trained like build_tiny_models':
    "target" (the tiny target's tokenizer) and "draft" (the tiny drafter's)."""
    return {
        "target": write_model(
            root / "gemma-target",
            train_tokenizer(corpus("target"), 600),
            64,
            3,
            seed=5,
            train_text=TEXT,
            train_steps=steps,
            window=window,
        ),
        "draft": write_model(
            root / "gemma-draft",
            train_tokenizer(corpus("draft"), 420),
            48,
            3,
            seed=6,
            train_text=TEXT,
            train_steps=steps,
            window=window,
        ),
    }
