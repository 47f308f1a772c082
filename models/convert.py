"""Convert a GGUF file (llama.cpp) into an MLX model directory.

The result loads with `mlx_lm.load(str(out_dir))`: dequantized weights under
Hugging Face names (model.safetensors), an HF-style config.json, and
tokenizer.json + tokenizer_config.json rebuilt from the GGUF vocabulary.
"""

import hashlib
import json
import os
import platform
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.paths import INFO_FILE

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")
SUPPORTED_QUANTS = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms around attention and MLP have their own names.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def default_dtype() -> str:
    # Linux MLX runs on the CPU, where float16 matmuls are slow and imprecise.
    return "float16" if platform.system() == "Darwin" else "float32"


def convert_dir(src: Path, out_dir: Path, dtype: str, group_size: int = 64) -> Path:
    """An MLX model directory in another dtype: float32/float16/bfloat16 cast the
    float weights, q8/q4 quantize with mlx-lm's own quantization (the
    mlx-community format: QuantizedLinear/QuantizedEmbedding with scales and
    biases). Tokenizer files and the conversion record are copied along."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    from omnidraft_mlx.models.catalog import DTYPES, QUANT_BITS

    if dtype not in DTYPES:
        raise OmniDraftError(f"unknown dtype '{dtype}': use one of {', '.join(DTYPES)}")
    src, out_dir = Path(src), Path(out_dir)
    model, config = load_model(src, lazy=True)
    if "quantization" in config:
        raise OmniDraftError(f"{src} is already quantized: convert from a float model")
    if dtype in QUANT_BITS:
        model, config = quantize_model(model, config, group_size, QUANT_BITS[dtype])
    else:
        to = getattr(mx, dtype)
        model.update(tree_map(lambda v: v.astype(to) if mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))
        config["torch_dtype"] = dtype
    with staged_dir(out_dir) as tmp:
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INFO_FILE):
                shutil.copy(f, tmp / f.name)
        save_model(tmp, model, donate_model=True)
        save_config(config, tmp / "config.json")
        info = json.loads((src / INFO_FILE).read_text()) if (src / INFO_FILE).is_file() else {}
        info.update(dtype=dtype, converted_from=src.name)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))
    return out_dir


def sha256_file(path, chunk=1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _meta(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _open(gguf_path):
    import gguf

    try:
        return gguf.GGUFReader(str(gguf_path))
    except (ValueError, OSError) as e:
        raise OmniDraftError(f"cannot read GGUF file {gguf_path}: {e}") from None


def hf_name(name: str, arch: str) -> str:
    """HF parameter name of a GGUF tensor name such as 'blk.3.attn_q.weight'."""
    parts = name.split(".")
    if parts[0] == "blk":
        table = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
        layer, base, kind = parts[1], parts[2], ".".join(parts[3:])
        if base in table:
            return f"model.layers.{layer}.{table[base]}.{kind}"
    elif parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{'.'.join(parts[1:])}"
    raise OmniDraftError(f"unsupported tensor '{name}' in this {arch} GGUF")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (it interleaves the rotary halves)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _dequantize(tensor) -> np.ndarray:
    from gguf import quants

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_QUANTS:
        raise OmniDraftError(
            f"unsupported GGUF tensor type {kind} ({tensor.name}): supported types are " + ", ".join(SUPPORTED_QUANTS)
        )
    # GGUF lists dims innermost first; numpy wants them outermost first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def model_config(reader, arch: str, vocab_size: int, tied: bool) -> dict:
    """config.json for mlx-lm's llama / qwen2 / gemma3_text model classes."""

    def m(key, default=None):
        return _meta(reader, f"{arch}.{key}", default)

    n_heads = int(m("attention.head_count"))
    hidden = int(m("embedding_length"))
    head_dim = int(m("attention.key_length", hidden // n_heads))
    config = {
        "model_type": {"gemma3": "gemma3_text"}.get(arch, arch),
        "hidden_size": hidden,
        "num_hidden_layers": int(m("block_count")),
        "intermediate_size": int(m("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(m("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(m("context_length", 32768)),
        "rope_theta": float(m("rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
    }
    if arch == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
    if arch == "gemma3":
        config.update(
            query_pre_attn_scalar=head_dim,
            sliding_window=int(m("attention.sliding_window", 512)),
            sliding_window_pattern=6,  # five local layers, then one global
            rope_local_base_freq=10000.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    for key in ("bos_token_id", "eos_token_id"):
        value = _meta(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    return config


def _eos_ids(reader, config: dict) -> list:
    """EOS ids for generation: the GGUF's eos, plus <|endoftext|>/<eos> style end tokens."""
    tokens = _meta(reader, "tokenizer.ggml.tokens", [])
    ids = [config["eos_token_id"]] if "eos_token_id" in config else []
    for extra in ("<|endoftext|>", "<|im_end|>", "<end_of_turn>", "<eos>"):
        if extra in tokens[:300000]:
            i = tokens.index(extra)
            if i not in ids:
                ids.append(i)
    return ids


def _hf_weights(reader, arch: str, mx_dtype) -> dict:
    """Every tensor of the GGUF, dequantized, as mlx-lm expects it, under its Hugging Face name."""
    import mlx.core as mx

    n_head = int(_meta(reader, f"{arch}.attention.head_count"))
    n_kv = int(_meta(reader, f"{arch}.attention.head_count_kv", n_head))

    # Check every tensor before the slow part, so bad input fails at once.
    for t in reader.tensors:
        hf_name(t.name, arch)
        if t.tensor_type.name not in SUPPORTED_QUANTS:
            _dequantize(t)

    weights = {}
    for t in reader.tensors:
        w = _dequantize(t)
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, n_head)
        elif arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, n_kv)
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w); mlx-lm adds the 1 itself
        weights[hf_name(t.name, arch)] = mx.array(w).astype(mx_dtype)
        del w
    return weights


def convert_gguf(gguf_path, out_dir, dtype=None, sha256=None) -> Path:
    """Convert `gguf_path` into the MLX model directory `out_dir` (replaced atomically).

    dtype: "float32", "float16" or "bfloat16" (default: float32 on Linux, float16 on macOS).
    sha256: the GGUF's hash when already known (recorded in omnidraft.json).
    """
    import mlx.core as mx

    from omnidraft_mlx.models.tokenizer import save_tokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    start = time.time()
    reader = _open(gguf_path)
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise OmniDraftError(f"unsupported GGUF architecture '{arch}': supported are {', '.join(SUPPORTED_ARCHS)}")
    dtype = dtype or default_dtype()
    if dtype == "float16" and arch == "gemma3":
        dtype = "bfloat16"  # Gemma activations overflow float16
    weights = _hf_weights(reader, arch, getattr(mx, dtype))
    tied = "output.weight" not in {t.name for t in reader.tensors}
    vocab_size = int(weights["model.embed_tokens.weight"].shape[0])
    config = model_config(reader, arch, vocab_size, tied)
    config["eos_token_id"] = _eos_ids(reader, config) or config.get("eos_token_id")
    config["torch_dtype"] = dtype

    with staged_dir(out_dir) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights
        with open(tmp / "config.json", "w") as f:
            json.dump(config, f, indent=2)
        save_tokenizer(reader, arch, tmp)
        info = {
            "source": "gguf",
            "gguf_file": gguf_path.name,
            "gguf_sha256": sha256 or sha256_file(gguf_path),
            "arch": arch,
            "quantization": sorted({t.tensor_type.name for t in reader.tensors}),
            "dtype": dtype,
            "convert_seconds": round(time.time() - start, 1),
        }
        with open(tmp / INFO_FILE, "w") as f:
            json.dump(info, f, indent=2)
    return out_dir


@contextmanager
def staged_dir(out_dir: Path):
    """A fresh temp directory beside out_dir that replaces it when the block
    succeeds and is deleted when it fails: out_dir is never half-written."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(src: Path, dst: Path) -> None:
    """Move directory src to dst; an existing dst is swapped out, then deleted."""
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
