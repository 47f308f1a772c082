"""Every weight format a Mac user runs: tiny models converted in the test to
float16, bfloat16 and 4-bit (mlx-lm's quantization), as drafter and target:
greedy output equals the target's own, exact sampling keeps its distribution,
adaptation stays finite and learns, profiles save and load."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from test_models_convert import home, tiny_spec  # noqa: F401 (fixtures)
from tiny_models import TEXT, corpus, train_tokenizer, write_model

from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.decode.speculative import SpecConfig, SpecStats, speculative_generate
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.learn.distill import DistillConfig, Distiller, make_example, setup_trainable
from omnidraft_mlx.models.convert import convert_dir
from omnidraft_mlx.pair import make_pair
from omnidraft_mlx.profile.adapter import fuse_lora
from omnidraft_mlx.profile.store import Profile, load_profile
from omnidraft_mlx.prompts import encode_prompt, user_messages

PROMPTS = ["def add_7(x):\n    return x + 7\n\nprint(add_7(21))  # two\n\ndef add_1", "print(add_3(9))  # four\n"]
DTYPES = ["float32", "float16", "bfloat16", "q4", "q8"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_dirs):
    """Model dirs per (role, dtype): the tiny target and a 64-wide tiny drafter
    (4-bit groups of 32 need widths divisible by 32), converted by convert_dir."""
    root = tmp_path_factory.mktemp("dtypes")
    draft = write_model(
        root / "draft", train_tokenizer(corpus("draft"), 420), 64, 2, seed=7, train_text=TEXT, train_steps=200
    )
    out = {}
    for role, src in (("draft", draft), ("target", tiny_dirs["target"])):
        out[role, "float32"] = src
        for dtype in DTYPES[1:]:
            out[role, dtype] = convert_dir(src, root / f"{role}-{dtype}", dtype, group_size=32)
    return out


_loaded = {}


def model(dirs, role, dtype):
    if (role, dtype) not in _loaded:
        _loaded[role, dtype] = load(str(dirs[role, dtype]))
    return _loaded[role, dtype]


def check_format(m, dtype):
    kinds = {type(x) for _, x in m.named_modules()}
    if dtype.startswith("q"):
        assert nn.QuantizedLinear in kinds and nn.QuantizedEmbedding in kinds and nn.Linear not in kinds
    else:
        assert m.model.layers[0].self_attn.q_proj.weight.dtype == getattr(mx, dtype)


@pytest.mark.parametrize("target_dtype", ["float32", "float16", "q4"])
@pytest.mark.parametrize("draft_dtype", ["float32", "float16", "q4"])
def test_greedy_lossless_matrix(dirs, draft_dtype, target_dtype):
    (dm, dt), (tm, tt) = model(dirs, "draft", draft_dtype), model(dirs, "target", target_dtype)
    check_format(dm, draft_dtype)
    check_format(tm, target_dtype)
    pair = make_pair(dm, dt, tm, tt)
    accepted = rejected = 0
    for prompt in PROMPTS:
        dp, tp = dt.encode(prompt), tt.encode(prompt)
        stats = SpecStats()
        out = [t for new, _ in speculative_generate(pair, dp, tp, SpecConfig(k=3, max_tokens=32), stats) for t in new]
        assert out == list(plain_generate(tm, tt, tp, PlainStats(), max_tokens=32))
        accepted += stats.accepted
        rejected += stats.proposed - stats.accepted
    assert accepted > 0 and rejected > 0


def test_bfloat16_and_q8_decode_losslessly(dirs):
    (dm, dt), (tm, tt) = model(dirs, "draft", "q8"), model(dirs, "target", "bfloat16")
    check_format(dm, "q8")
    check_format(tm, "bfloat16")
    pair = make_pair(dm, dt, tm, tt)
    tp = tt.encode(PROMPTS[0])
    out = [
        t
        for new, _ in speculative_generate(pair, dt.encode(PROMPTS[0]), tp, SpecConfig(k=3, max_tokens=32), SpecStats())
        for t in new
    ]
    assert out == list(plain_generate(tm, tt, tp, PlainStats(), max_tokens=32))


@pytest.mark.parametrize("draft_dtype", ["float16", "q4"])
def test_adaptation_update_is_finite_and_learns(dirs, tmp_path, draft_dtype):
    dm, dt = load(str(dirs["draft", draft_dtype]))  # a private copy: training changes it
    tm, tt = model(dirs, "target", "float16")
    cfg = DistillConfig(lora_rank=4, lr=1e-2, steps=2)
    setup_trainable(dm, cfg)
    pair = make_pair(dm, dt, tm, tt)
    examples = []
    for prompt in PROMPTS:
        tp = encode_prompt(tt, user_messages(prompt))
        reply = list(plain_generate(tm, tt, tp, PlainStats(), max_tokens=24))
        examples.append(make_example(pair, encode_prompt(dt, user_messages(prompt)), tp, reply))
    first, second = Distiller(pair, cfg).steps(examples)
    assert np.isfinite(first.loss) and np.isfinite(second.loss) and first.kl > 0
    assert second.loss < first.loss

    # The adapter goes into the pair's profile and comes back onto a fresh drafter of that dtype.
    profile = Profile(tmp_path / "prof", str(dirs["draft", draft_dtype]), str(dirs["target", "float16"]), pair.ngrams)
    profile.save(dm, distill=cfg.__dict__, corpus="c", position=1)
    fresh, _ = load(str(dirs["draft", draft_dtype]))
    x = mx.array([encode_prompt(dt, user_messages(PROMPTS[0]))])
    base = np.array(fresh(x).astype(mx.float32))
    load_profile(profile.draft, profile.target, fresh, path=profile.path)
    # Fused as loading fuses it: float16 fusion rounds (up to ~10 ulps on a logit), so unfused is not the reference.
    fuse_lora(dm)
    trained = np.array(dm(x).astype(mx.float32))
    np.testing.assert_array_equal(np.array(fresh(x).astype(mx.float32)), trained)
    assert np.abs(base - trained).max() > 0.1


def test_quantized_drafter_trains_only_through_lora(dirs):
    dm, _ = load(str(dirs["draft", "q4"]))
    with pytest.raises(OmniDraftError, match="LoRA"):
        setup_trainable(dm, DistillConfig(lora_rank=0))


def test_exact_sampling_in_float16(dirs, tiny):
    """tests/test_sampling.py's chi-square, both models in float16."""
    from test_sampling import CASES, LENGTH, SAMPLES, TEMP, TOP_P

    from omnidraft_mlx.bench.sampling_bias import exact_sequence_probs, fit, sample_sequences

    prompt, sources = CASES["drafter"]

    (dm, dt), (tm, tt) = load(str(dirs["draft", "float16"])), model(dirs, "target", "float16")
    pair = make_pair(dm, dt, tm, tt)
    tp = encode_prompt(tt, user_messages(prompt), True)
    expected = exact_sequence_probs(tm, tp, set(tt.eos_token_ids) | {pair.vmap.target_eos}, LENGTH, TEMP, TOP_P)
    counts, stats = sample_sequences(pair, prompt, "exact", SAMPLES, LENGTH, TEMP, TOP_P, sources=sources)
    pvalue, categories = fit(counts, expected)
    assert categories >= 5 and 0 < stats.accepted < stats.proposed
    assert pvalue > 1e-3, f"float16 exact sampling deviates from the target (p={pvalue:.2g})"


def test_convert_refuses_bad_input(dirs, tmp_path):
    with pytest.raises(OmniDraftError, match="unknown dtype"):
        convert_dir(dirs["target", "float32"], tmp_path / "x", "int3")
    with pytest.raises(OmniDraftError, match="already quantized"):
        convert_dir(dirs["target", "q4"], tmp_path / "y", "q8")


def test_derive_refuses_a_quantized_source(dirs, home):
    from omnidraft_mlx.models.derive import DeriveConfig, derive

    with pytest.raises(OmniDraftError, match="is quantized: derive from a float model"):
        derive(DeriveConfig(source=str(dirs["draft", "q4"]), layers=1, name="tiny-1l"), progress=False)


def test_pull_names_each_dtype_apart(tiny_spec, home):
    """A catalog model pulled in other dtypes: NAME-DTYPE, resolvable by that name, listed with its dtype."""
    from omnidraft_mlx.models import pull as pull_mod
    from omnidraft_mlx.models.catalog import local_name
    from omnidraft_mlx.models.convert import default_dtype

    half = pull_mod.pull("tiny", progress=False, dtype="float16")
    assert half.name == local_name("tiny", "float16", default_dtype())
    q8 = pull_mod.resolve_model("tiny-q8")  # the float model first, then mlx-lm's quantization of it
    assert q8 == str(home / "models" / "tiny-q8") and pull_mod.is_model_dir(home / "models" / "tiny")
    dtypes = {r["name"]: r["dtype"] for r in pull_mod.local_state() if r["status"] == "ready"}
    assert dtypes == {"tiny": default_dtype(), half.name: "float16", "tiny-q8": "q8"}
    with pytest.raises(OmniDraftError, match="unknown dtype"):
        pull_mod.pull("tiny", progress=False, dtype="q3")


@pytest.mark.real
def test_real_4bit_qwen_target_is_lossless():
    """Qwen2.5-Coder-0.5B quantized to 4 bits (from the pulled float model, cached
    under the model home as qwen2.5-coder-0.5b-q4), SmolLM2 drafting."""
    from test_lossless_real import PROMPTS as REAL_PROMPTS
    from test_lossless_real import check_pair
    from test_lossless_real import model as real_model

    from omnidraft_mlx.models.pull import local_state

    acceptance, pair = check_pair("smollm2-135m", "qwen2.5-coder-0.5b-q4", REAL_PROMPTS[:2], 24, k=4)
    check_format(real_model("qwen2.5-coder-0.5b-q4")[0], "q4")
    assert acceptance > 0.2
    row = next(r for r in local_state() if r["name"] == "qwen2.5-coder-0.5b-q4")
    assert row["dtype"] == "q4" and row["catalog"]
