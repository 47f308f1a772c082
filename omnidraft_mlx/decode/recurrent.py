"""Recurrent layers that roll back: the state after each position of a forward.

Hybrid and recurrent models (Qwen3.5, Qwen3-Next, OLMo hybrid, Kimi Linear, LFM2, Mamba-1/2,
Jamba, Nemotron-H, Granite 4, Falcon-H1, PLaMo 2, RecurrentGemma, RWKV-7, Bailing linear) keep an
ArraysCache per recurrent layer: short-convolution or token-shift states (the last
inputs) and a recurrent state. A verify forward over k draft tokens absorbs all of
them, and a rejected token cannot be subtracted back out. So the same forward keeps
what gives the state after each of its positions (Steps: by reference, nothing
copied), and a rollback takes the one at the accepted length:

- convolution / token-shift state: free, the inputs ending at the accepted position,
  all in the convolution's own (padded) input, which a Conv1d subclass keeps;
- gated delta state: mlx-lm's ops path steps over the positions anyway; each step's
  state is kept (gated_delta's step function wrapped); on Metal, one launch of
  mlx-lm's masked kernel over a batch row per position gives them all;
- Mamba-2 state: mlx-lm's chunked scan returns only the last state; the one at the
  accepted length is the same sum over the accepted positions only, computed on
  rollback from the inputs the scan was given (ssm_state); Jamba's scan likewise;
- Mamba-1, RWKV-7 and RG-LRU states: their scans step per position (or output the
  states, RG-LRU), each kept;
- Bailing's gated linear attention: it returns the last state only; the one at the
  accepted length is its recurrence over the accepted positions, run on rollback;
- LongCat's n-gram embedding: its state is the last token ids, the window ending there.

mlx-lm's layers are used as they are: they read their cache (StepsCache, an
ArraysCache that notes which of its slots was read last), call the convolution and
the recurrence functions and write the final states back; `advance(T)` closes the
layer's forward (the few blocks that do not call it get a small adapter class that
does: ADAPTERS). Only a prepared model's own layers keep steps: each takes a subclass
whose methods that call a recurrence are copies looking it up in a copy of their
module's globals, where it is wrapped (acting only right after a StepsCache was
read); mlx-lm's modules, their functions and every other model stay as they are.
What is wrapped or overridden must have the parameters it has in the mlx-lm versions
known here (KNOWN, MLX_LM): prepare() refuses another in one line.

A StepsCache also keeps the states at the last few offsets it passed through
(references, no copies), so a drafter's one-token forwards roll back too. Rolling
back further than that is refused (`can_trim`); KVSlot then starts the sequence
afresh where its caller feeds it again.

Batched rows (batch.py) stack their states (RowsStates) and each gets back its own.
Trees are verified as chains on these models (kvcache.py): a branch's state would
depend on its own path.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import ssm
from mlx_lm.models.cache import ArraysCache, CacheList

from omnidraft_mlx.errors import OmniDraftError

HISTORY = 16  # offsets whose states a StepsCache keeps (one-token forwards: a drafter's draft)
RECORD_MAX = 64  # forwards longer than this (prompt processing) keep only their last state

MLX_LM = "mlx-lm>=0.32.0,<0.33"  # the versions whose recurrences KNOWN describes (pyproject.toml pins the same)
# What this module wraps, overrides or calls in mlx-lm, with its parameters there: one that differs
# would keep wrong steps or none, so prepare() refuses it (known()).
KNOWN = {
    "gated_delta.gated_delta_update": "q k v a b A_log dt_bias state mask use_kernel lower_bound allow_neg_eigval",
    "gated_delta.gated_delta_ops": "q k v g beta state mask",
    "gated_delta._gated_delta_step_ops": "q k v g beta state mask",
    "ssm.ssm_update": "hidden_states A_log B C D dt dt_bias state time_step_limit mask lengths",
    "ssm.compute_dt": "dt dt_bias time_step_limit",
    "recurrent_gemma.rnn_scan": "x a h0",
    "recurrent_gemma.Conv1d.__call__": "self x cache",
    "bailing_moe_linear.recurrent_gla": "q k v g scale h",
    "bailing_hybrid.recurrent_gla": "q k v g scale h mask chunk",
    "mamba.MambaBlock.ssm_step": "self x A state",
    "jamba.JambaMambaMixer.ssm_step": "self x A state",
    "rwkv7.TokenShift.__call__": "self x state",
    "rwkv7.Rwkv7TimeMixing._wkv7": "self r w k v a b state",
    "rwkv7._wkv7_step_ops": "r w k v a b state",
    "longcat_flash_ngram.NgramEmbedding.__call__": "self input_ids cache",
}

_read: tuple | None = None  # (StepsCache, slot) read last: the layer about to run its recurrence


@dataclass
class Steps:
    """What a layer's forward over n positions kept for one cache slot: at(m), the slot's value after
    its first m positions (1 <= m <= n), computed only when a rollback asks (nothing is copied before)."""

    n: int
    at: Callable[[int], mx.array]

    def row(self, r: int, n: int) -> Steps:
        """Row r of a batch, n positions of its own."""
        return Steps(n, lambda m: self.at(m)[r : r + 1])


class StepsCache(ArraysCache):
    """A recurrent layer's cache that can roll back into its last forward."""

    def __init__(self, size: int):
        super().__init__(size)
        self.offset = 0  # positions absorbed
        self.records: dict[int, Steps] = {}  # slot -> what the layer's forward kept
        self.steps: tuple[int, int, dict] | None = None  # (start, length, records) of the last forward
        self.closed = True  # the last forward has advanced: the next read starts another
        self.history: dict[int, list] = {0: list(self.cache)}  # offset -> slot values there

    def __getitem__(self, idx):
        global _read
        value = self.cache[idx]  # first: unpacking a cache (kimi_linear) reads past its end, IndexError
        if self.closed:
            self.records, self.closed = {}, False
        _read = (self, idx)
        return value

    def record(self, idx: int, steps: Steps) -> None:
        """Keep what the layer's forward computed for slot idx (its convolution may run after advance)."""
        self.records[idx] = steps

    def slot_shapes(self) -> list:
        return [None if v is None else v.shape for v in self.cache]

    def value(self, idx: int):
        return self.cache[idx]

    def advance(self, N: int):
        """The layer's forward over N positions is done."""
        super().advance(N)
        self.steps, self.closed = (self.offset, N, self.records), True
        self.offset += N
        self._remember()

    def _fits(self, idx: int, steps: Steps, N: int) -> bool:
        now = self.cache[idx]
        return now is not None and steps.n == N and steps.at(1).shape == now.shape  # shapes only: nothing runs

    def _remember(self) -> None:
        self.history[self.offset] = list(self.cache)
        for old in sorted(self.history)[:-HISTORY]:
            del self.history[old]

    def _at(self, offset: int) -> list | None:
        """The slot values after `offset` positions, if kept."""
        if offset in self.history:
            return self.history[offset]
        if self.steps is None:
            return None
        start, n, records = self.steps
        m = offset - start
        kept = [i for i, c in enumerate(self.cache) if c is not None]
        if not 0 < m < n or not all(i in records and self._fits(i, records[i], n) for i in kept):
            return None
        values = list(self.cache)
        for idx, steps in records.items():
            values[idx] = steps.at(m)
        return values

    def can_trim(self, n: int) -> bool:
        return n <= 0 or self._at(self.offset - n) is not None

    def is_trimmable(self):
        return False  # not any n (mlx-lm's prompt cache would trim it blindly): see can_trim

    def trim(self, n: int) -> int:
        values = self._at(self.offset - n) if n > 0 else list(self.cache)
        if values is None:
            return 0
        self.cache = list(values)
        self.offset -= n
        self.history = {o: v for o, v in self.history.items() if o <= self.offset}
        self._remember()
        return n

    def reset(self) -> None:
        self.__init__(len(self.cache))

    @property
    def nbytes(self) -> int:
        """The states held, the kept earlier ones included (what a prompt cache should count)."""
        held = {id(a): a for values in [self.cache, *self.history.values()] for a in values if a is not None}
        return sum(a.nbytes for a in held.values())

    def __deepcopy__(self, memo) -> StepsCache:
        """A copy holds the current states only (mlx-lm's prompt cache copies what it hands out)."""
        copy = StepsCache(len(self.cache))
        copy.cache, copy.offset = list(self.cache), self.offset
        copy.history = {self.offset: list(self.cache)}
        return copy


_NO_STATE = object()


def _recorder(state=_NO_STATE) -> tuple | None:
    """(cache, slot) to record into: the cache read last, unless its layer's forward is done and
    already recorded that slot (then the read was not a layer's about to run: a model's own check).
    Given the state a recurrence was handed, only if it is that slot's (not another cache's, as
    when mlx-lm's own caches run the same model after this one's was read)."""
    if _read is None:
        return None
    cache, idx = _read
    if getattr(cache, "closed", False) and idx in cache.records:
        return None
    return _read if state is _NO_STATE or state is cache.value(idx) else None


class RowsStates(ArraysCache):
    """One recurrent layer's StepsCaches of a batch's rows (batch.py), seen as one cache: the rows'
    states stacked on the batch axis, their tokens right-padded to the longest (padding comes after
    a row's own tokens, so it never reaches them). finish() gives each row's cache what its own
    forward over its own tokens would have left: the states at its length, and its records."""

    lengths = left_padding = None  # no masking: the padding is dropped at finish()

    def __init__(self, caches: list, widths: list[int]):
        self.caches, self.widths = caches, widths
        self.records: dict[int, Steps] = {}
        self.written: dict[int, mx.array] = {}
        self.stacked: dict[int, mx.array | None] = {}

    def __getitem__(self, idx):
        global _read
        value = self.value(idx)  # first, as StepsCache's
        _read = (self, idx)
        return value

    def value(self, idx: int):
        """The rows' values stacked (the same array each read: recurrences are matched by identity)."""
        if idx in self.written:
            return self.written[idx]
        if idx not in self.stacked:
            values = [c.cache[idx] for c in self.caches]
            like = next((v for v in values if v is not None), None)
            stack = None if like is None else mx.concatenate([mx.zeros_like(like) if v is None else v for v in values])
            self.stacked[idx] = stack
        return self.stacked[idx]

    def __setitem__(self, idx, value):
        self.written[idx] = value

    def record(self, idx: int, steps: Steps) -> None:
        self.records[idx] = steps

    def slot_shapes(self) -> list:
        return [None if v is None else (len(self.caches), *v.shape[1:]) for v in self.caches[0].cache]

    def make_mask(self, N: int):
        return None

    def advance(self, N: int):
        pass  # finish() advances each row by its own width

    def finish(self) -> None:
        short = min(self.widths) < max(self.widths)
        if short and any(idx not in self.records for idx in self.written):
            raise OmniDraftError("a recurrent layer kept no per-position state: its rows cannot share a forward")
        for r, (c, n) in enumerate(zip(self.caches, self.widths)):
            values, records = list(c.cache), {i: steps.row(r, n) for i, steps in self.records.items()}
            for idx, value in self.written.items():
                values[idx] = records[idx].at(n) if idx in records else value[r : r + 1]
            c.cache, c.steps, c.closed = values, (c.offset, n, records), True
            c.offset += n
            c._remember()


class StepsConv1d(nn.Conv1d):
    """A recurrent layer's short convolution that hands its padded input to the cache just read."""

    def __call__(self, x: mx.array) -> mx.array:
        _record_window(x, self.weight.shape[1] - 1)
        return super().__call__(x)


def _record_window(x: mx.array, keep: int, padded: bool = True) -> None:
    """A state that is the last `keep` inputs: a convolution's padded input (K-1 earlier inputs,
    then the new ones; the state after m new inputs is the K-1 ending there), or (padded=False) the
    new inputs alone, keep=1 (RWKV's token shift). Its slot: the first of that shape in the cache
    read last that this forward has not recorded yet (olmo_hybrid convolves q, k and v into slots
    0, 1, 2; RWKV-7 shifts into 0, then 2)."""
    if (to := _recorder()) is None:
        return
    cache, shape = to[0], (x.shape[0], keep, *x.shape[2:])
    free = [(i, s) for i, s in enumerate(cache.slot_shapes()) if i not in cache.records]  # in call order
    idx = next((i for i, s in free if s == shape), None)
    if idx is None:  # a fresh cache: the first empty slot (convolutions come before their recurrence)
        idx = next((i for i, s in free if s is None), None)
    if idx is not None and padded:
        cache.record(idx, Steps(x.shape[1] - keep, lambda m: x[:, m : m + keep]))
    elif idx is not None:
        cache.record(idx, Steps(x.shape[1], lambda m: x[:, m - keep : m]))


_steps: list | None = None  # gated delta states, collected while a StepsCache's layer runs


def _collecting_step(step):
    def collect(*args, **kwargs):
        y, state = step(*args, **kwargs)
        if _steps is not None:
            _steps.append(state)
        return y, state

    return collect


def _stepping(update):
    """A copy of gated_delta_update whose ops path hands each step's state to `_steps`: it and
    gated_delta_ops look their globals up in a copy of gated_delta's, its step function wrapped."""
    module = sys.modules[update.__module__]
    scope = dict(vars(module))
    scope["_gated_delta_step_ops"] = _collecting_step(known(module, "_gated_delta_step_ops"))
    scope["gated_delta_ops"] = _rebound(known(module, "gated_delta_ops"), scope)
    return _rebound(update, scope)


def _kernel_rows() -> bool:
    """Whether gated delta layers run mlx-lm's Metal kernel here (it returns the last state only)."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def _gated_delta_rows(update, call) -> tuple[mx.array, mx.array, list]:
    """The kernel's way to every position's state in one launch: row (b, j) of a batch of B*T
    rows masks the positions after j, so its final state is the state after position j; the
    last row of each b is the unmasked forward, whose outputs are the layer's."""
    q = call["q"]
    B, T = q.shape[:2]
    rows = {n: mx.repeat(call[n], T, axis=0) for n in ("q", "k", "v", "a", "b")}
    state = call.get("state")
    mask = mx.tile(mx.arange(T)[None, :] <= mx.arange(T)[:, None], (B, 1))  # row j: positions 0..j
    y, states = update(
        **{**call, **rows, "state": None if state is None else mx.repeat(state, T, axis=0), "mask": mask}
    )
    states = states.reshape(B, T, *states.shape[1:])
    return y.reshape(B, T, *y.shape[1:])[:, -1], states[:, -1], [states[:, j] for j in range(T)]


def _keeping_gated_delta(update):
    """gated_delta_update that, after a StepsCache read, records the state after each position."""
    signature, stepping = inspect.signature(update), _stepping(update)

    def keeping(*args, **kwargs):
        global _steps
        call = signature.bind(*args, **kwargs).arguments
        to = _recorder(call.get("state"))
        if to is None or not 1 < args[0].shape[1] <= RECORD_MAX:
            y, state = update(*args, **kwargs)
            if to is not None and args[0].shape[1] == 1:
                to[0].record(to[1], Steps(1, lambda m: state))
            return y, state
        if _kernel_rows() and call.get("mask") is None:
            y, state, steps = _gated_delta_rows(update, call)
        else:
            _steps = []
            try:
                y, state = stepping(**{**call, "use_kernel": False})
                steps = _steps  # each step's state: computed by the ops path anyway, kept by reference
            finally:
                _steps = None
        to[0].record(to[1], Steps(len(steps), lambda m: steps[m - 1]))
        return y, state

    return keeping


def ssm_state(x, A_log, B, C, D, dt, dt_bias, state=None, time_step_limit=(0.001, 100.0), *_, m: int, **__) -> mx.array:
    """Mamba-2's state after the first m positions: ssm.ssm_attn's final-state sum over those only."""
    h, g = x.shape[2], B.shape[2]
    dt = ssm.compute_dt(dt[:, :m], dt_bias, time_step_limit)  # [b, m, h]
    cum = mx.cumsum(dt * (-mx.exp(A_log).astype(dt.dtype)).reshape(1, 1, -1), axis=1)
    decay = mx.exp(cum[:, -1:] - cum)  # [b, m, h]: from each position to the m-th
    dtx = dt[..., None] * x[:, :m]  # [b, m, h, dh]
    Bh = mx.repeat(B[:, :m], h // g, axis=2).astype(dtx.dtype)  # [b, m, h, n]
    out = mx.einsum("bih,bihp,bihn->bhpn", decay, dtx, Bh)
    return out if state is None else out + mx.exp(cum[:, -1])[..., None, None] * state


def _keeping_ssm(update):
    """ssm_update that, after a StepsCache read, records the state after each position."""
    signature = inspect.signature(update)
    known(ssm, "compute_dt")  # ssm_state's

    def keeping(*args, **kwargs):
        out = update(*args, **kwargs)
        state = signature.bind(*args, **kwargs).arguments.get("state")
        if (to := _recorder(state)) is not None and (n := args[0].shape[1]) <= RECORD_MAX:
            to[0].record(to[1], Steps(n, lambda m: out[1] if m == n else ssm_state(*args, **kwargs, m=m)))
        return out

    return keeping


def _keeping_rnn_scan(scan):
    """RecurrentGemma's rnn_scan (RG-LRU): its outputs are the states after each position."""

    def keeping(x, a, h0):
        y, last = scan(x, a, h0)
        if (to := _recorder(h0)) is not None and (n := x.shape[1]) <= RECORD_MAX:
            to[0].record(to[1], Steps(n, lambda m: last if m == n else y[:, m - 1]))
        return y, last

    return keeping


def _keeping_gla(gla):
    """Bailing's linear attention (recurrent_gla, heads before positions): it returns the last state
    only; the state after m positions is the same recurrence over the first m, run on rollback."""
    signature = inspect.signature(gla)

    def keeping(*args, **kwargs):
        y, last = gla(*args, **kwargs)
        call = signature.bind(*args, **kwargs).arguments
        if (to := _recorder(call.get("h"))) is not None and (n := call["q"].shape[2]) <= RECORD_MAX:

            def at(m):
                head = {a: call[a][:, :, :m] for a in ("q", "k", "v")}
                if call.get("mask") is not None:
                    head["mask"] = call["mask"][:, :m]
                return gla(**{**call, **head})[1]

            to[0].record(to[1], Steps(n, lambda m: last if m == n else at(m)))
        return y, last

    return keeping


WRAPPERS = {
    "gated_delta_update": _keeping_gated_delta,
    "ssm_update": _keeping_ssm,
    "rnn_scan": _keeping_rnn_scan,
    "recurrent_gla": _keeping_gla,
}
_scopes: dict[str, dict] = {}  # an mlx-lm module's name -> its globals, copied, its recurrences wrapped


def _scope(module_name: str) -> dict:
    if module_name not in _scopes:
        module = sys.modules[module_name]
        scope = dict(vars(module))
        for name, wrap in WRAPPERS.items():
            if name in scope:
                scope[name] = wrap(known(module, name))
        _scopes[module_name] = scope
    return _scopes[module_name]


def _rebound(f, scope: dict):
    """A copy of function f that looks its globals up in `scope` (f keeps its module's)."""
    copy = types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__, f.__closure__)
    copy.__kwdefaults__ = f.__kwdefaults__
    return functools.update_wrapper(copy, f)


def _names(code) -> set[str]:
    """The global and attribute names a function's code uses, its nested functions' included."""
    return set(code.co_names).union(*(_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def _keeping(cls) -> type:
    """cls, or (a method of it calls a recurrence) a subclass whose such methods are copies calling
    it wrapped (_scope): only instances given the subclass keep steps."""
    methods, seen = {}, set()
    for klass in cls.__mro__:
        for name, f in vars(klass).items():
            if name not in seen and isinstance(f, types.FunctionType) and f.__module__.startswith("mlx_lm."):
                if WRAPPERS.keys() & _names(f.__code__):
                    methods[name] = _rebound(f, _scope(f.__module__))
            seen.add(name)
    return type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__}) if methods else cls


def known(owner, name: str):
    """owner's `name` (owner: an mlx-lm module or class), if its parameters are the ones KNOWN has."""
    f = getattr(owner, name, None)
    where = owner.__name__ if isinstance(owner, types.ModuleType) else f"{owner.__module__}.{owner.__qualname__}"
    key = (f"{where}.{name}" if f is None else f"{f.__module__}.{f.__qualname__}").removeprefix("mlx_lm.models.")
    have, want = None if f is None else " ".join(inspect.signature(f).parameters), KNOWN.get(key)
    if have is None or have != want:
        raise OmniDraftError(
            f"mlx-lm {version('mlx-lm')}'s {key} is {'missing' if have is None else f'({have})'}, not "
            f"{f'the ({want})' if want else 'one'} that recurrent rollback knows: pip install '{MLX_LM}'"
        )
    return f


def _advancing(block):
    """A recurrent block that, like most of mlx-lm's, advances its cache when its forward is done."""

    class Advancing(block):
        def __call__(self, x, *args, **kwargs):
            out = super().__call__(x, *args, **kwargs)
            cache = next((a for a in (*args, *kwargs.values()) if isinstance(a, ArraysCache)), None)
            if cache is not None:
                cache.advance(x.shape[1])
            return out

    return Advancing


def _mamba1(block):
    """Mamba-1's block (mamba.py): its scan steps a method per position; each step's state kept."""
    known(block, "ssm_step")

    class Mamba1(_advancing(block)):
        def ssm_step(self, x, A, state=None):
            y, state = super().ssm_step(x, A, state)
            if _steps is not None:
                _steps.append(state)
            return y, state

        def __call__(self, x, cache):
            global _steps
            keep = isinstance(cache, StepsCache | RowsStates) and x.shape[1] <= RECORD_MAX
            _steps = steps = [] if keep else None
            try:
                out = super().__call__(x, cache)
            finally:
                _steps = None
            if keep:  # after the forward (a record before its first read would be cleared)
                cache.record(1, Steps(len(steps), lambda m: steps[m - 1]))  # cache[1]: its state
            return out

    return Mamba1


def _gemma_conv(conv):
    """RecurrentGemma's own Conv1d: it pads inside, so the padded input is rebuilt to be kept."""
    known(conv, "__call__")

    class GemmaConv(conv):
        def __call__(self, x, cache=None):
            keep = self.weight.shape[1] - 1
            pad = [(0, 0), (keep, 0), (0, 0)]
            _record_window(mx.pad(x, pad) if cache is None else mx.concatenate([cache, x], axis=1), keep)
            return super().__call__(x, cache)

    return GemmaConv


def _token_shift(shift):
    """RWKV-7's token shift: its state after m inputs is the m-th input."""
    known(shift, "__call__")

    class TokenShift(shift):
        def __call__(self, x, state):
            _record_window(x, 1, padded=False)
            return super().__call__(x, state)

    return TokenShift


def _rwkv7_time_mixing(mixing):
    """RWKV-7's time mixing: its wkv recurrence stepped by mlx-lm's own step op, each state kept."""
    known(mixing, "_wkv7")

    class TimeMixing(mixing):
        def _wkv7(self, r, w, k, v, a, b, state):
            to = _recorder(state)
            if to is None or not 1 < r.shape[1] <= RECORD_MAX:
                y, state = super()._wkv7(r, w, k, v, a, b, state)
                if to is not None and r.shape[1] == 1:
                    to[0].record(to[1], Steps(1, lambda m: state))
                return y, state
            if state is None:
                state = mx.zeros((r.shape[0], self.num_heads, self.head_dim, self.head_dim), dtype=r.dtype)
            ys, states = [], []
            for t in range(r.shape[1]):
                y, state = rwkv7_step(r[:, t], w[:, t], k[:, t], v[:, t], a[:, t], b[:, t], state)
                ys.append(y)
                states.append(state)
            to[0].record(to[1], Steps(len(states), lambda m: states[m - 1]))
            return mx.stack(ys, axis=1).astype(r.dtype), state

    rwkv7_step = known(sys.modules[mixing.__module__], "_wkv7_step_ops")
    return TimeMixing


def _jamba_mixer(mixer):
    """Jamba's Mamba mixer scans all positions in one call that returns the last state only: the
    state after m positions is the same scan over the first m of its inputs, run on rollback."""
    known(mixer, "ssm_step")

    class JambaMixer(_advancing(mixer)):
        def ssm_step(self, x, A, state=None):
            y, last = super().ssm_step(x, A, state)
            if (to := _recorder(state)) is not None and (n := x.shape[1]) <= RECORD_MAX:
                scan = super().ssm_step
                to[0].record(to[1], Steps(n, lambda m: last if m == n else scan(x[:, :m], A, state)[1]))
            return y, last

    return JambaMixer


def _token_window(embedding):
    """LongCat's n-gram embedding: its state is the last n - 1 token ids, the window ending at m."""
    known(embedding, "__call__")

    class TokenWindow(embedding):
        def __call__(self, input_ids, cache=None):
            if not isinstance(cache, StepsCache | RowsStates):
                return super().__call__(input_ids, cache)
            before = cache[0]
            out = super().__call__(input_ids, cache)
            n, keep = input_ids.shape[-1], self.n - 1
            ids = input_ids.astype(mx.int64)
            ids = ids if before is None else mx.concatenate([before, ids], axis=-1)
            start = ids.shape[-1] - n
            cache.record(0, Steps(n, lambda m: ids[..., max(0, start + m - keep) : start + m]))
            cache.advance(n)  # the embedding's forward is done (it does not advance its cache)
            return out

    return TokenWindow


# Blocks that need a small adapter (by module and class name), made once per class.
ADAPTERS = {
    ("mamba", "MambaBlock"): _mamba1,
    ("recurrent_gemma", "RecurrentBlock"): _advancing,
    ("recurrent_gemma", "Conv1d"): _gemma_conv,
    ("jamba", "JambaMambaMixer"): _jamba_mixer,
    ("bailing_moe_linear", "LinearAttention"): _advancing,
    ("longcat_flash_ngram", "NgramEmbedding"): _token_window,
    ("rwkv7", "Rwkv7Layer"): _advancing,
    ("rwkv7", "TokenShift"): _token_shift,
    ("rwkv7", "Rwkv7TimeMixing"): _rwkv7_time_mixing,
}
_prepared: dict[type, type] = {nn.Conv1d: StepsConv1d}  # mlx-lm's class -> its instances' in a prepared model


def _prepared_class(cls) -> type:
    """The class an instance of cls takes in a prepared model: cls keeping its recurrence's steps
    (_keeping), adapted where it needs to be (ADAPTERS); cls itself where nothing applies."""
    if cls not in _prepared and cls not in _prepared.values():
        make = ADAPTERS.get((cls.__module__.rsplit(".", 1)[-1], cls.__name__))
        _prepared[cls] = _keeping(cls) if make is None else make(_keeping(cls))
    return _prepared.get(cls, cls)


def _supported(module) -> bool:
    """A layer module whose recurrence can keep its steps: gated delta, Mamba-1/2, RG-LRU, RWKV-7,
    gated linear attention, a short convolution or a window of token ids only."""
    name = module.__name__.rsplit(".", 1)[-1]
    return any(hasattr(module, f) for f in WRAPPERS) or name in (
        "lfm2",
        "lfm2_moe",
        "mamba",
        "jamba",
        "rwkv7",
        "longcat_flash_ngram",
    )


def prepare(model) -> bool:
    """Make `model`'s recurrent layers keep their steps (idempotent; its own layers only); False when
    a layer's recurrence is one this module does not know (its caches stay mlx-lm's: no speculation).
    An mlx-lm whose recurrences differ from KNOWN's: OmniDraftError, the model left as it was."""
    modules = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__module__.startswith("mlx_lm.")}
    if not all(_supported(m) for m in modules if getattr(m, "ArraysCache", None) is ArraysCache):
        return False
    classes = [(m, _prepared_class(type(m))) for m in model.modules()]  # all made (or refused) first
    for m, cls in classes:
        m.__class__ = cls
    return True


def steps_caches(cache: list, model) -> list:
    """The model's cache with every ArraysCache a StepsCache (inside CacheLists too), where prepare() allows."""
    if not any(_has_arrays(c) for c in cache) or not prepare(model):
        return cache
    return [_stepped(c) for c in cache]


def _has_arrays(c) -> bool:
    return type(c) is ArraysCache or (isinstance(c, CacheList) and any(_has_arrays(s) for s in c.caches))


def _stepped(c):
    if type(c) is ArraysCache:
        return StepsCache(len(c.cache))
    if isinstance(c, CacheList):
        return StepsCacheList(*(_stepped(s) for s in c.caches))
    return c


class StepsCacheList(CacheList):
    """A CacheList (a layer with recurrent and attention parts side by side, Falcon-H1) with an offset."""

    @property
    def offset(self) -> int:
        return max(c.offset for c in self.caches)


def rows_view(caches: list, widths: list[int], view):
    """One layer's caches of a batch's rows as one: RowsStates for recurrent ones, `view(caches)`
    (batch.RowsView) for attention ones, a CacheList of both for a layer with both."""
    if isinstance(caches[0], StepsCache):
        return RowsStates(caches, widths)
    if isinstance(caches[0], CacheList):
        return CacheList(
            *(rows_view([c.caches[i] for c in caches], widths, view) for i in range(len(caches[0].caches)))
        )
    return view(caches)


def finish_rows(views: list) -> None:
    """After the batch's forward: each row's recurrent caches take their own states."""
    for v in views:
        for s in layers(v):
            if isinstance(s, RowsStates):
                s.finish()


def layers(c) -> list:
    """A layer's caches (a CacheList holds several)."""
    return [s for sub in c.caches for s in layers(sub)] if isinstance(c, CacheList) else [c]
