"""Loading models by any name: catalog name, local directory, GGUF file or hub id."""

from __future__ import annotations

from omnidraft_mlx.errors import OmniDraftError


def load_model(name: str):
    """(model, tokenizer) for a catalog name (pulled on first use), a local
    MLX/HF directory, a .gguf file (converted once) or a Hugging Face id."""
    from mlx_lm import load

    from omnidraft_mlx.models.pull import resolve_model

    path = resolve_model(name)
    try:
        return load(path)
    except Exception as e:  # mlx-lm raises many kinds; the user needs one line
        raise OmniDraftError(
            f"could not load model '{name}' ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
            "check the name with `omnidraft models list`, or pass a local model directory"
        ) from e
