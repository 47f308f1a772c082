"""A causal LM's parts, found by what they are rather than by attribute names.

mlx-lm's families name their parts differently: the text model may sit inside a
wrapper (`language_model`, settings under `text_config`), the layers under
`.model`, `.transformer` or `.backbone`, the embedding as `embed_tokens`, `wte`,
`tok_embeddings` or `embeddings`, the output head as `lm_head`, `output`, the
tied embedding, or inside the backbone (gpt_neox), and the logits may be
soft-capped or scaled after it. What every family shares: a causal LM whose
`__call__` runs a backbone (the module holding the token embedding) and turns
its output into logits. So the backbone is the parent of the token embedding,
the causal LM its parent, and both directions are run through the LM's own
`__call__` with the backbone stood in for:

- hidden states: the backbone runs as the LM calls it, and the call stops there
  (no logits over the whole prefill);
- logits from hidden states: the stand-in returns them, and the rest of the LM's
  `__call__` (head, tying, soft-capping, scaling) runs as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.cache import make_prompt_cache

from omnidraft_mlx.errors import OmniDraftError

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_sequence_length")


@dataclass(frozen=True)
class Anatomy:
    lm: nn.Module  # the causal LM: the text model inside any wrapper
    backbone: str  # lm[backbone]: the token embedding and the layers
    args: object  # the text model's settings

    @property
    def family(self) -> str:
        return str(getattr(self.args, "model_type", type(self.lm).__module__.rsplit(".", 1)[-1]))


class _Stop(Exception):
    """Raised by the stand-in to end the LM's call once the backbone has run."""

    def __init__(self, hidden):
        self.hidden = hidden


class _StandIn:
    """In the LM's place of its backbone for one call: runs it and stops (hidden is None), or
    returns the given hidden states. Attribute reads go to the backbone (`self.model.wte`)."""

    def __init__(self, backbone, hidden: mx.array | None):
        self._backbone, self._hidden = backbone, hidden

    def __getattr__(self, name):
        return getattr(self._backbone, name)

    def __call__(self, *args, **kwargs):
        if self._hidden is None:
            raise _Stop(self._backbone(*args, **kwargs))
        return self._hidden


def _token_embedding(model) -> str:
    """The dotted path of the largest embedding table (the tokens'; position tables sit beside it)."""
    found = [
        (getattr(m, "num_embeddings", None) or m.weight.shape[0], path)
        for path, m in model.named_modules()
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)) and path
    ]
    if not found:
        raise OmniDraftError(f"{type(model).__module__}: no token embedding found: not a causal LM omnidraft can run")
    return max(found)[1]


def _settings(module):
    """A module's settings, by type (mlx-lm's ModelArgs, under `args`, `config` or any name); a
    wrapper's own point to its text model's (`text_config`)."""
    args = next((v for v in vars(module).values() if isinstance(v, BaseModelArgs)), None)
    text_config = getattr(args, "text_config", None)
    if getattr(args, "vocab_size", None) is None and isinstance(text_config, dict):
        return SimpleNamespace(**text_config)  # a wrapped text model's settings kept as a dict
    return args


def anatomy(model) -> Anatomy:
    """The model's parts (found once, then kept on the model). The backbone is an ancestor of the
    token embedding (its parent, or higher where the embedding sits in a module of its own), the
    LM the backbone's parent: the deepest pair whose two directions give the model's own logits."""
    found = model.__dict__.get("_omnidraft_anatomy")
    if found is not None:
        return found
    path = _token_embedding(model).split(".")
    inputs = mx.arange(1, 4)[None]
    want = model(inputs, cache=make_prompt_cache(model))
    for depth in range(len(path) - 2, -1, -1):
        lm = model
        for key in path[:depth]:
            lm = lm[int(key)] if isinstance(lm, list) else lm[key]
        candidate = Anatomy(lm, path[depth], _settings(lm) or _settings(model) or SimpleNamespace())
        object.__setattr__(model, "_omnidraft_anatomy", candidate)
        try:
            got = logits(model, hidden_states(model, inputs, make_prompt_cache(model)))
            if got.shape == want.shape and mx.allclose(got, want, atol=1e-2, rtol=1e-2).item():
                return candidate
        except Exception:  # noqa: BLE001 - not this pair: try the next one up
            pass
        object.__delattr__(model, "_omnidraft_anatomy")
    raise OmniDraftError(
        f"{type(model).__module__.rsplit('.', 1)[-1]}: its hidden states and output head are not where omnidraft "
        "looks for them: use plain decoding (--model) for it, and report the family"
    )


def text_model(model) -> nn.Module:
    """The causal LM inside any wrapper (`language_model`)."""
    return anatomy(model).lm


def settings(model):
    """The text model's settings (a wrapper's `text_config`, not the wrapper's own)."""
    return anatomy(model).args


def family(model) -> str:
    return anatomy(model).family


def vocab_size(model) -> int:
    """Rows of the output head's logits: the settings' vocabulary, else the embedding's."""
    size = getattr(settings(model), "vocab_size", None)
    if size is None:
        a = anatomy(model)
        emb = a.lm[a.backbone]
        size = next(m.weight.shape[0] for _, m in emb.named_modules() if isinstance(m, nn.Embedding))
    return int(size)


def context_length(model) -> int | None:
    """The longest context the model was configured for, if its settings say."""
    args = settings(model)
    return next((int(v) for k in CONTEXT_KEYS if (v := getattr(args, k, None))), None)


def _with_stand_in(model, hidden, call):
    # The LM's backbone is swapped for the call: a model is run by one thread at a time (the engine's
    # loop, tree.py's rewiring likewise), never concurrently.
    a = anatomy(model)
    backbone = a.lm[a.backbone]
    a.lm[a.backbone] = _StandIn(backbone, hidden)
    try:
        return call(a.lm)
    finally:
        a.lm[a.backbone] = backbone


def hidden_states(model, inputs: mx.array, cache: list | None = None) -> mx.array:
    """The backbone's output for inputs (batch x tokens), run as the LM runs it, written into cache."""
    try:
        _with_stand_in(model, None, lambda lm: lm(inputs, cache=cache))
    except _Stop as stop:
        hidden = stop.hidden
        return hidden[0] if isinstance(hidden, tuple) else hidden
    raise OmniDraftError(f"{family(model)}: its forward does not run its backbone; use plain decoding (--model)")


def logits(model, hidden: mx.array) -> mx.array:
    """The LM's logits for hidden states (any leading shape, last axis the hidden size), computed by
    the rest of the LM's own forward (head, tying, soft-capping, scaling)."""
    lead = hidden.shape[:-1]
    flat = hidden.reshape(1, -1, hidden.shape[-1])
    out = _with_stand_in(model, flat, lambda lm: lm(mx.zeros(flat.shape[:2], mx.int32), cache=None))
    return out.reshape(*lead, out.shape[-1])


def output_head(model):
    """hidden -> logits for the model (logits())."""
    return lambda hidden: logits(model, hidden)
