"""Online hybrid distillation on the tiny models: byte-offset alignment, the loss
against a plain numpy computation, training that lowers the loss and raises
acceptance, the profile (save, resume, kill -9, disk full) and bad input."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from omnidraft_mlx.decode.policy import LearnedPolicy, PolicyConfig
from omnidraft_mlx.decode.speculative import SpecConfig
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.learn.adapt import (
    Budget,
    OnlineLearner,
    Sample,
    evaluate,
    learn_from_target,
    learn_speculative,
    read_corpus,
)
from omnidraft_mlx.learn.distill import DistillConfig, Distiller, _pad, distill_loss, make_example, setup_trainable
from omnidraft_mlx.pair import make_pair
from omnidraft_mlx.profile.store import Profile, load_profile
from omnidraft_mlx.prompts import encode_prompt, user_messages
from omnidraft_mlx.vocab.align import align
from omnidraft_mlx.vocab.tokenmap import VocabMap

# The target's tokenizer learned from json/textwrap/typing: it merges these words, the drafter's does not.
SPLIT_TEXT = "def dumps(obj, *, skipkeys=False):\n    return textwrap.dedent(s)  # naïve 日本語\n"
TRAIN_PROMPTS = [f"def add_{i}(x):\n    return x + {i}\n\nprint(add_{i}(" for i in range(40, 48)]


def hand_vmap() -> VocabMap:
    draft = [b"de", b"f", b" fl", b"ake", b"(x", b")", None]
    target = [b"def", b" flake", b"(", b"x", b")", b" fl", b"ake", None]
    d2t = np.array([target.index(b) if b in target else -1 for b in draft], dtype=np.int64)
    d2t[6] = 7
    return VocabMap(d2t, draft, target, frozenset({6}), 7, False)


def test_alignment_by_hand():
    vmap = hand_vmap()
    # "def flake(x)": target def | flake | ( | x | ), drafter de f | fl ake | (x | )
    al = align([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4], vmap)
    assert al.direct == [(5, 4)]  # ")" = ")"
    assert al.ngram == [(0, 0), (1, 0), (2, 1), (3, 1)]  # de+f = def, fl+ake = flake; "(x" crosses
    # The target splitting " fl" + "ake" as the drafter does: both direct.
    al = align([0, 1, 2, 3, 5], [0, 5, 6, 4], vmap)
    assert al.direct == [(2, 1), (3, 2), (4, 3)] and al.ngram == [(0, 0), (1, 0)]
    # Texts that differ: alignment stops at the first differing byte.
    al = align([0, 1, 2, 3, 5], [0, 5, 2], vmap)
    assert al.direct == [(2, 1)] and al.ngram == [(0, 0), (1, 0)]


def test_alignment_on_real_tokenizers(cross):
    vmap = cross.vmap
    text = SPLIT_TEXT
    t_ids = list(cross.target_tok.encode(text, add_special_tokens=False))
    d_ids = list(cross.draft_tok.encode(text, add_special_tokens=False))
    al = align(d_ids, t_ids, vmap)
    assert al.direct and al.ngram
    for i, j in al.direct:
        assert vmap.draft_bytes[d_ids[i]] == vmap.target_bytes[t_ids[j]]
    runs = {}
    for i, j in al.ngram:
        runs.setdefault(j, []).append(i)
    for j, idx in runs.items():
        assert len(idx) >= 2 and idx == list(range(idx[0], idx[-1] + 1))
        assert b"".join(vmap.draft_bytes[d_ids[i]] for i in idx) == vmap.target_bytes[t_ids[j]]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def numpy_loss(pair, examples, lam):
    """The loss, straight from the definition, one unpadded sequence at a time."""
    d2t = pair.vmap.draft_to_target
    cols = {}
    for d in np.nonzero(d2t >= 0)[0]:
        cols.setdefault(int(d2t[d]), int(d))  # one draft column per target id
    t_cols, d_cols = np.array(sorted(cols)), np.array([cols[t] for t in sorted(cols)])
    kl = nll = count = 0.0
    for ex in examples:
        dl = np.array(pair.draft(mx.array(ex.draft_ids)[None])[0].astype(mx.float32))
        tl = np.array(pair.target(mx.array(ex.target_ids)[None])[0].astype(mx.float32))
        for i, j in zip(ex.direct_draft, ex.direct_target):
            logq, logp = log_softmax(dl[i, d_cols]), log_softmax(tl[j, t_cols])
            kl += float((np.exp(logq) * (logq - logp)).sum())
        for i, tok in zip(ex.ngram_pos, ex.ngram_tok):
            nll -= float(log_softmax(dl[i])[tok])
        count += len(ex.direct_draft) + len(ex.ngram_pos)
    return (kl + lam * nll) / count, kl, nll


def test_loss_matches_numpy(cross):
    replies = [SPLIT_TEXT, "import json\nclass Generic(Protocol):\n"]
    examples = [
        make_example(
            cross,
            encode_prompt(cross.draft_tok, m),
            encode_prompt(cross.target_tok, m),
            list(cross.target_tok.encode(r, add_special_tokens=False)),
        )
        for m, r in zip((user_messages(TRAIN_PROMPTS[0]), user_messages("print(add_3(9))  # ")), replies)
    ]
    assert all(len(e.direct_draft) and len(e.ngram_pos) for e in examples)
    assert len(examples[0].draft_ids) != len(examples[1].draft_ids)  # padding is exercised
    d = Distiller(cross, DistillConfig())
    from omnidraft_mlx.learn.distill import _flat, target_logprobs

    x = _pad([e.draft_ids for e in examples])
    w = x.shape[1]
    loss, kl, nll = distill_loss(
        cross.draft,
        x,
        _flat([e.direct_draft for e in examples], w),
        target_logprobs(cross, examples, d.target_cols),
        _flat([e.ngram_pos for e in examples], w),
        mx.array(np.concatenate([e.ngram_tok for e in examples])),
        d.draft_cols,
        0.2,
    )
    ref = numpy_loss(cross, examples, 0.2)
    np.testing.assert_allclose([loss.item(), kl.item(), nll.item()], ref, rtol=2e-4, atol=1e-4)
    assert kl.item() > 0  # the two tiny models disagree: the reverse KL is not trivially zero


def test_a_same_vocabulary_example_keeps_the_targets_own_tokens(tiny):
    """A drafter sharing the target's vocabulary reads the target's ids as they are (drafter.sync),
    so it learns from them, not from their canonical re-tokenization."""
    (dm, dt), (tm, tt) = tiny["same"], tiny["target"]
    pair = make_pair(dm, dt, tm, tt)
    reply = list(tt.encode("\n", add_special_tokens=False)) * 3
    assert list(tt.encode("\n\n\n", add_special_tokens=False)) != reply  # three newline tokens are not canonical
    ex = make_example(pair, [1], [1], reply)
    assert ex.draft_ids[1:] == reply and len(ex.direct_draft) == 3


def test_step_without_ngram_positions(tiny_dirs, tiny):
    dm, dt = load(str(tiny_dirs["draft"]))
    tm, tt = tiny["target"]
    mx.random.seed(0)
    setup_trainable(dm, DistillConfig(lora_rank=4))
    pair = make_pair(dm, dt, tm, tt)
    ex = make_example(pair, [1], [1], list(tt.encode("    return x + 7\n", add_special_tokens=False)))
    assert len(ex.direct_draft) and not len(ex.ngram_pos)
    # Adam's first step moves every LoRA B entry by +-lr (the sign of its gradient, some of them rounding
    # noise): at 1e-2 that overshot on CI's CPU; at 1e-3 the loss fell for each of 150 seeds here.
    first, second = Distiller(pair, DistillConfig(lora_rank=4, steps=2, lr=1e-3)).steps([ex])
    assert first.ngram == 0 and first.nll == 0 and np.isfinite(first.loss) and first.kl > 0
    assert second.loss < first.loss  # the second step reuses the target's distributions and still learns


@pytest.mark.parametrize("rank", [8, 0])
def test_training_lowers_loss_and_raises_acceptance(tiny_dirs, tiny, rank):
    dm, dt = load(str(tiny_dirs["draft"]))  # a private copy: training changes it
    tm, tt = tiny["target"]
    cfg = DistillConfig(lr=3e-3, lora_rank=rank)
    setup_trainable(dm, cfg)
    pair = make_pair(dm, dt, tm, tt)
    prompts = [user_messages(p) for p in TRAIN_PROMPTS]
    before = evaluate(pair, prompts, max_tokens=32)["acceptance"]
    learner = OnlineLearner(pair, cfg, interval=4)  # ten updates: at 5 (mlx 0.32) acceptance rose by 0.04
    losses = []
    for _ in range(5):
        learn_speculative(learner, [Sample(messages=m) for m in prompts], SpecConfig(max_tokens=32), Budget())
        learner.position = 0
        losses.append(learner.last.loss)
    after = evaluate(pair, prompts, max_tokens=32)["acceptance"]
    assert losses[-1] < losses[0]
    assert after > before + 0.05, (before, after)


def test_target_mode_learns_from_the_targets_own_greedy_replies(tiny_dirs, tiny):
    from omnidraft_mlx.decode.plain import PlainStats, plain_generate

    dm, dt = load(str(tiny_dirs["draft"]))
    tm, tt = tiny["target"]
    cfg = DistillConfig(lr=1e-3, lora_rank=4)
    setup_trainable(dm, cfg)
    pair = make_pair(dm, dt, tm, tt)
    prompts = [user_messages(p) for p in TRAIN_PROMPTS[:3] + ["import json\n\ndef load(path):\n    with", "x = ["]]
    policy = LearnedPolicy(PolicyConfig(name="learned"))
    learner = OnlineLearner(pair, cfg, interval=3, policy=policy)
    records = learn_from_target(learner, [Sample(messages=m) for m in prompts], 12, Budget(max_prompts=4))
    # The acceptance head learned from replays of the replies (a label per drafted token).
    assert policy.head.net is not None and len(policy.head.labels) >= sum(len(r["reply"]) for r in records) // 2
    assert [r["position"] for r in records] == [1, 2, 3, 4] and learner.position == 4
    assert learner.updates == 2 and not learner.buffer  # 3 prompts, then the 1 the budget left
    for msgs, r in zip(prompts, records):  # prompts of several lengths share a padded batch
        plain = list(plain_generate(tm, tt, encode_prompt(tt, msgs), PlainStats(), max_tokens=12))
        assert r["reply"] == plain  # the replies the speculative mode would have verified
    fresh = make_pair(dm, dt, tm, tt)  # the cache holds what the replies teach it
    for r in records:
        fresh.learn_ngrams(r["reply"])
    assert len(pair.ngrams) == len(fresh.ngrams) > 0


def make_trained_profile(tmp_path, tiny_dirs, tiny, updates=2):
    dm, dt = load(str(tiny_dirs["draft"]))
    tm, tt = tiny["target"]
    cfg = DistillConfig(lr=1e-3, lora_rank=4)
    setup_trainable(dm, cfg)
    pair = make_pair(dm, dt, tm, tt)
    profile = Profile(tmp_path / "prof", str(tiny_dirs["draft"]), str(tiny_dirs["target"]), pair.ngrams)
    learner = OnlineLearner(pair, cfg, interval=4, profile=profile)
    learner.corpus = "c"
    learn_speculative(
        learner,
        [Sample(messages=user_messages(p)) for p in TRAIN_PROMPTS[: 4 * updates]],
        SpecConfig(max_tokens=16),
        Budget(),
    )
    return pair, profile


def test_task_corpus_teacher_forced_learns_the_reference_and_speculative_answers_the_prompt(cross):
    from omnidraft_mlx.learn.adapt import asked, task_corpus, text_examples

    sample = task_corpus("math", "adapt")[0]
    assert [m["role"] for m in sample.messages] == ["user", "assistant"]
    assert asked(sample.messages) == sample.messages[:1] and asked(sample.messages[:1]) == sample.messages[:1]
    (ex,) = text_examples(cross, sample, max_len=2048)
    reference = list(cross.target_tok.encode(sample.messages[1]["content"], add_special_tokens=False))
    assert ex.target_ids[-len(reference) :] == reference  # the reply is the reference, after the prompt
    assert len(ex.target_ids) > len(reference) and ex.positions


def test_task_corpus_interleaves_several_tasks():
    from omnidraft_mlx.learn.adapt import task_corpus

    single = {t: task_corpus(t, "adapt") for t in ("complete", "math", "chat")}
    mixed = task_corpus("complete, math,chat", "adapt")
    assert [s.messages for s in mixed[:6]] == [single[t][i].messages for i in (0, 1) for t in single]
    assert len(mixed) == sum(len(s) for s in single.values())
    assert mixed[-1].messages == single["math"][-1].messages  # the longest split's rest comes last


def test_profile_roundtrip(tmp_path, tiny_dirs, tiny):
    pair, profile = make_trained_profile(tmp_path, tiny_dirs, tiny)
    assert profile.updates == 2 and profile.position("c") == 8
    fresh, _ = load(str(tiny_dirs["draft"]))
    x = mx.array([encode_prompt(pair.draft_tok, user_messages(TRAIN_PROMPTS[0]))])
    base = fresh(x)
    loaded = load_profile(profile.draft, profile.target, fresh, path=profile.path)
    assert len(loaded.ngrams) == len(pair.ngrams) > 0
    # The adapter is applied (and fused): the reloaded drafter computes what the trained one does.
    np.testing.assert_allclose(np.array(fresh(x)), np.array(pair.draft(x)), atol=1e-4)
    assert not np.allclose(np.array(base), np.array(pair.draft(x)), atol=1e-3)
    # Resuming restores the optimizer state, step count included.
    learner = OnlineLearner(
        pair,
        DistillConfig(lora_rank=4),
        profile=load_profile(
            profile.draft, profile.target, load(str(tiny_dirs["draft"]))[0], trainable=True, path=profile.path
        ),
    )
    assert int(learner.distiller.opt.state["step"]) == 2


def test_profile_for_other_models_is_refused(tmp_path, tiny_dirs, tiny):
    _, profile = make_trained_profile(tmp_path, tiny_dirs, tiny, updates=1)
    # Same directory, other pair of names: the identities recorded do not match.
    with pytest.raises(OmniDraftError, match="another draft model"):
        load_profile(str(tiny_dirs["same"]), profile.target, path=profile.path)
    manifest = json.loads((profile.path / "manifest.json").read_text())
    (profile.path / "manifest.json").write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(OmniDraftError, match="format 99"):
        load_profile(profile.draft, profile.target, path=profile.path)


KILL_CHILD = textwrap.dedent("""
    import sys
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load
    from omnidraft_mlx.learn.distill import DistillConfig, setup_trainable
    from omnidraft_mlx.profile.store import load_profile
    draft, target, path = sys.argv[1:4]
    model, _ = load(draft)
    profile = load_profile(draft, target, model, trainable=True, path=path)
    if not profile.distill:
        setup_trainable(model, DistillConfig(lora_rank=4))
    while True:
        n = profile.updates + 1
        # Every weight of update n is n: a torn save would mix values.
        model.update(tree_map(lambda a: mx.full(a.shape, float(n)), model.trainable_parameters()))
        profile.save(model, distill=DistillConfig(lora_rank=4).__dict__, corpus="c", position=n)
        print(n, flush=True)
""")


def test_kill_during_save_keeps_previous_profile(tmp_path, tiny_dirs):
    path = tmp_path / "prof"
    args = [sys.executable, "-c", KILL_CHILD, str(tiny_dirs["draft"]), str(tiny_dirs["target"]), str(path)]
    rng = np.random.default_rng(0)
    for _ in range(4):
        child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        child.stdout.readline()  # at least one complete save in this process
        time.sleep(float(rng.uniform(0, 0.3)))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        model, _ = load(str(tiny_dirs["draft"]))
        profile = load_profile(str(tiny_dirs["draft"]), str(tiny_dirs["target"]), model, trainable=True, path=path)
        from omnidraft_mlx.profile.adapter import trainable_weights

        values = {float(v.min()) for v in trainable_weights(model).values()} | {
            float(v.max()) for v in trainable_weights(model).values()
        }
        assert values == {float(profile.updates)} and profile.position("c") == profile.updates


DISK_FULL_CHILD = textwrap.dedent("""
    import resource, signal, sys
    from mlx_lm import load
    from omnidraft_mlx.learn.distill import DistillConfig
    from omnidraft_mlx.errors import OmniDraftError
    from omnidraft_mlx.profile.store import load_profile
    draft, target, path = sys.argv[1:4]
    model, _ = load(draft)
    profile = load_profile(draft, target, model, trainable=True, path=path)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # no file can grow past 4 kB
    try:
        profile.save(model, distill=profile.distill, corpus="c", position=99)
    except OmniDraftError as e:
        print(e)
""")


def test_failed_save_keeps_previous_profile(tmp_path, tiny_dirs, tiny):
    _, profile = make_trained_profile(tmp_path, tiny_dirs, tiny, updates=1)
    before = sorted(p.name for p in profile.path.iterdir())
    manifest = (profile.path / "manifest.json").read_bytes()
    out = subprocess.run(
        [sys.executable, "-c", DISK_FULL_CHILD, profile.draft, profile.target, str(profile.path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.startswith("could not save the profile") and "previous profile is intact" in out.stdout
    assert len(out.stdout.strip().splitlines()) == 1
    assert sorted(p.name for p in profile.path.iterdir()) == before  # no temporary file left behind
    assert (profile.path / "manifest.json").read_bytes() == manifest
    assert load_profile(profile.draft, profile.target, load(str(tiny_dirs["draft"]))[0], path=profile.path).updates == 1


def test_bad_corpus(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n\n{"prompt": "ok"\n')
    with pytest.raises(OmniDraftError, match=r"bad.jsonl:3: not valid JSON"):
        read_corpus(bad)
    bad.write_text('{"prompt": "hi"}\n{"text": "no prompt"}\n')
    with pytest.raises(OmniDraftError, match=r"bad.jsonl:2: expected"):
        read_corpus(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(OmniDraftError, match="is empty"):
        read_corpus(empty)
    binary = tmp_path / "doc.txt"
    binary.write_bytes(b"%PDF-1.4\x00\x01\x02\xff")
    with pytest.raises(OmniDraftError, match="not a UTF-8 text document"):
        read_corpus(binary)
    with pytest.raises(OmniDraftError, match="no such corpus"):
        read_corpus(tmp_path / "missing")
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.md").write_text("# notes\nsome text")
    (folder / "b.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}))
    samples = read_corpus(folder)
    assert [s.text for s in samples] == ["# notes\nsome text", None] and samples[1].messages[0]["content"] == "q"


def omnidraft(*args, home, **env):
    env = {**os.environ, "OMNIDRAFT_HOME": str(home), **env}
    return subprocess.run(
        [sys.executable, "-m", "omnidraft_mlx.cli.main", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_adapt_command_resumes_and_profile_commands(tmp_path, tiny_dirs):
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("\n".join(json.dumps({"prompt": p}) for p in TRAIN_PROMPTS))
    pair_args = ["--draft", str(tiny_dirs["draft"]), "--target", str(tiny_dirs["target"])]
    common = [
        "adapt",
        str(corpus),
        *pair_args,
        "--interval",
        "2",
        "--max-tokens",
        "16",
        "--eval",
        "2",
        "--eval-tokens",
        "8",
        "--rank",
        "4",
    ]
    first = omnidraft(*common, "--mode", "speculative", "--max-prompts", "4", home=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "position 4/6" in first.stdout and "held-out acceptance" in first.stdout
    assert "evaluating on 2 held-out prompts (before)" in first.stderr  # a log file is told what the wait is
    streamed = int(
        re.search(r"acceptance head: (\d+) labelled", omnidraft("profile", "show", *pair_args, home=tmp_path).stdout)[1]
    )
    second = omnidraft(*common, "--rank", "8", home=tmp_path)  # resumes in the target mode, the default for prompts
    assert second.returncode == 0, second.stderr
    assert "position 6/6" in second.stdout and "update 3" in second.stdout
    assert "continuing the profile's adapter" in second.stderr
    shown = omnidraft("profile", "show", *pair_args, home=tmp_path)
    assert "drafter updates: 3" in shown.stdout and "6 items learned from" in shown.stdout
    # The acceptance head trained while speculating, then on the target mode's replays.
    assert (labels := re.search(r"acceptance head: (\d+) labelled", shown.stdout)) and int(labels[1]) > streamed
    # generate loads the profile (adapter applied) and keeps the output lossless.
    gen = omnidraft("generate", *pair_args, "--raw", "--max-tokens", "8", "-q", TRAIN_PROMPTS[0], home=tmp_path)
    plain = omnidraft(
        "generate",
        "--model",
        str(tiny_dirs["target"]),
        "--raw",
        "--max-tokens",
        "8",
        "-q",
        TRAIN_PROMPTS[0],
        home=tmp_path,
    )
    assert gen.returncode == 0 and gen.stdout == plain.stdout
    archive = tmp_path / "p.tar.gz"
    assert omnidraft("profile", "export", str(archive), *pair_args, home=tmp_path).returncode == 0
    import tarfile

    names = tarfile.open(archive).getnames()
    assert any(n.endswith("manifest.json") for n in names) and any("adapter-" in n for n in names)
    assert any("/accept_head-" in n for n in names)
    assert omnidraft("profile", "reset", *pair_args, home=tmp_path).returncode == 0
    assert "no profile yet" in omnidraft("profile", "show", *pair_args, home=tmp_path).stdout


def test_adapt_command_bad_input(tmp_path, tiny_dirs):
    pair_args = ["--draft", str(tiny_dirs["draft"]), "--target", str(tiny_dirs["target"])]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    out = omnidraft("adapt", str(bad), *pair_args, home=tmp_path)
    assert out.returncode == 2 and "bad.jsonl:2" in out.stderr and "Traceback" not in out.stderr
    doc = tmp_path / "doc.txt"
    doc.write_text("def add_1(x):\n    return x + 1\n")
    for mode in ("speculative", "target", "batch"):  # an old name is still taken
        out = omnidraft("adapt", str(doc), *pair_args, "--mode", mode, home=tmp_path)
        assert out.returncode == 2 and "--mode teacher-forced" in out.stderr
    out = omnidraft("adapt", str(doc), *pair_args, "--mode", "feed", home=tmp_path)
    assert out.returncode == 2 and "use one of speculative, target, teacher-forced" in out.stderr
    out = omnidraft("adapt", str(doc), *pair_args, "--eval", "0", "--rank", "4", home=tmp_path)  # teacher-forced
    assert out.returncode == 0, out.stderr
    assert "update 1" in out.stdout


def long_run(tmp_path, tiny_dirs) -> list[str]:
    """adapt on more prompts than the tiny pair learns from in a minute (an update of 2 prompts per step)."""
    corpus = tmp_path / "many.jsonl"
    corpus.write_text("\n".join(json.dumps({"prompt": f"def add_{i}(x):\n    return x + {i}\n"}) for i in range(2000)))
    pair_args = ["--draft", str(tiny_dirs["draft"]), "--target", str(tiny_dirs["target"])]
    return ["adapt", str(corpus), *pair_args, "--interval", "2", "--max-tokens", "8", "--eval", "2", "--rank", "4"]


def saved_position(stdout: str) -> tuple[int, int]:
    """(position, corpus size) of the profile line adapt ends with."""
    found = re.search(r"position (\d+)/(\d+) of file:", stdout)
    return int(found[1]), int(found[2])


def test_adapt_with_no_bound_stops_after_the_stated_default_and_goes_on_from_there(tmp_path, tiny_dirs):
    help_text = omnidraft("adapt", "--help", home=tmp_path, COLUMNS="400").stdout  # each option's help on one line
    assert "Default: 20, unless --max-prompts is given; 0 = no time limit" in help_text
    args = long_run(tmp_path, tiny_dirs)
    first = omnidraft(*args, home=tmp_path, OMNIDRAFT_ADAPT_MINUTES="0.03")  # 1.8 s
    assert first.returncode == 0, first.stderr
    plan = first.stderr.splitlines()[0]  # the first line says when it stops
    assert plan.startswith("adapt: target mode on file:") and plan.endswith(
        "(1998 items); stops after 0.03 minutes of learning (the default: --minutes sets another, 0 = no limit); "
        "Ctrl-C or SIGTERM stops it once the update under way is saved"
    )
    assert re.search(
        r"^0\.03 minutes are up: learned from (\d+) prompts in (\d+) updates? over \d+ s$", first.stdout, re.M
    )
    position, total = saved_position(first.stdout)
    assert 0 < position < total == 1998
    go_on = re.search(rf"^to go on from item {position + 1} of 1998: (.*)$", first.stdout, re.M)[1]
    assert shlex.split(go_on) == ["omnidraft", *args]
    again = omnidraft(*args, home=tmp_path, OMNIDRAFT_ADAPT_MINUTES="0.03")
    assert again.returncode == 0, again.stderr
    assert f"(position {position + 2}/1998)" in again.stderr  # its first update took the next 2 prompts
    assert saved_position(again.stdout)[0] > position


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_adapt_once_the_update_under_way_is_saved(tmp_path, tiny_dirs, sig):
    child = subprocess.Popen(
        [sys.executable, "-m", "omnidraft_mlx.cli.main", *long_run(tmp_path, tiny_dirs), "--minutes", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMNIDRAFT_HOME": str(tmp_path)},
    )
    try:
        stderr = []
        for line in child.stderr:
            stderr.append(line)
            if "prompts/min" in line:  # an update saved: the run is learning
                break
        else:
            pytest.fail(f"no update reported (exit {child.wait()}): {''.join(stderr)}")
        assert "no time limit" in stderr[0]
        child.send_signal(sig)
        stdout, rest = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, rest
    assert f"{sig.name}: stopping on request once the update under way is saved" in rest
    learned = re.search(r"^stopped on request: learned from (\d+) prompts in (\d+) updates?", stdout, re.M)
    assert learned, stdout
    position, total = saved_position(stdout)
    assert position == int(learned[1]) < total  # every prompt answered was learned from, nothing more started
    assert f"to go on from item {position + 1} of {total}" in stdout
    assert "not measured after (stopped on request)" in stdout
    manifest = json.loads(next((tmp_path / "profiles").glob("*/manifest.json")).read_text())
    assert list(manifest["corpus"].values()) == [position]  # the profile holds where it stopped
    assert manifest["history"][-1]["position"] == position and len(manifest["history"]) == int(learned[2])


def test_a_second_ctrl_c_stops_adapt_at_once_saying_so(tmp_path, tiny_dirs):
    # Steps of 32 replies (seconds each on the tiny pair): both signals land in the same step.
    args = [*long_run(tmp_path, tiny_dirs), "--minutes", "0", "--interval", "32", "--max-tokens", "64", "--eval", "0"]
    child = subprocess.Popen(
        [sys.executable, "-m", "omnidraft_mlx.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMNIDRAFT_HOME": str(tmp_path)},
    )
    try:
        for line in child.stderr:
            if "prompts/min" in line:  # the first update saved, the second begun
                time.sleep(0.5)
                child.send_signal(signal.SIGINT)
            if "stopping on request" in line:
                child.send_signal(signal.SIGINT)
                break
        stdout, rest = child.communicate(timeout=120)
    finally:
        child.kill()
    assert (
        child.returncode == 130
        and "SIGINT again: stopping at once; what was learned since the last save is lost" in rest
    ), rest
    assert "learned from" not in stdout
    manifest = json.loads(next((tmp_path / "profiles").glob("*/manifest.json")).read_text())
    assert list(manifest["corpus"].values()) == [32] and len(manifest["history"]) == 1  # the first update, whole


def test_a_second_ctrl_c_handled_inside_a_del_still_stops_at_once():
    """Python runs a signal handler at the next bytecode, which may be inside a __del__ that a garbage
    collection started; the KeyboardInterrupt raised there is printed and dropped, and adapt went on to
    finish and save the update (the likely cause of the test above failing once so). A __del__ that gets
    the second SIGINT makes it happen here."""
    script = textwrap.dedent(
        """
        import signal, threading
        from omnidraft_mlx.cli.adapt_cmd import _stop_on_signals
        from omnidraft_mlx.collectives import world

        class Collected:
            def __del__(self):
                signal.raise_signal(signal.SIGINT)

        with _stop_on_signals(threading.Event(), world()):
            signal.raise_signal(signal.SIGINT)  # the first: stop after the update under way
            Collected()
            print("went on to save the update", flush=True)
        """
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 130 and "went on" not in child.stdout, (child.stdout, child.stderr)
    assert "SIGINT again: stopping at once" in child.stderr
