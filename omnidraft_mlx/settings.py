"""Settings: keyword-only dataclasses whose fields declare their flag and range
(setting()), checked in one place (check_settings, from __post_init__), so every
verb and any other front end rejects the same bad values with the same
one-line error, named by the command-line flag that sets them."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from omnidraft_mlx.errors import OmniDraftError

_CHECK = "omnidraft.check"  # the metadata key of a field made by setting()


@dataclass(frozen=True)
class _Check:
    flag: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    choices: tuple | None = None


def setting(
    default=MISSING,
    *,
    flag: str,
    low=None,
    high=None,
    open_low: bool = False,
    open_high: bool = False,
    choices=None,
    factory=MISSING,
):
    """A settings field that check_settings keeps within [low, high] (strictly where open_*) or
    among choices, naming `flag` when it is not; for a list, each item; None means unset."""
    check = _Check(flag, low, high, open_low, open_high, tuple(choices) if choices is not None else None)
    return field(default=default, default_factory=factory, metadata={_CHECK: check})


def flag_of(settings, name: str) -> str:
    """The command-line flag that sets the field `name` (declared with setting())."""
    return next(f for f in fields(settings) if f.name == name).metadata[_CHECK].flag


def check_settings(settings) -> None:
    """Raise a one-line OmniDraftError for the first field declared with setting() out of its range."""
    for f in fields(settings):
        if (check := f.metadata.get(_CHECK)) is None:
            continue
        value = getattr(settings, f.name)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is None:
                continue
            if check.choices is not None:
                check_choice(check.flag, item, check.choices)
            else:
                check_range(check.flag, item, check.low, check.high, open_low=check.open_low, open_high=check.open_high)


def check_range(flag: str, value, low=None, high=None, *, open_low: bool = False, open_high: bool = False) -> None:
    """Raise a one-line OmniDraftError unless low <= value <= high (strictly where open_*);
    a bound of None is no bound. NaN is always out of range."""
    ok_low = low is None or (value > low if open_low else value >= low)
    ok_high = high is None or (value < high if open_high else value <= high)
    if ok_low and ok_high:
        return
    parts = []
    if low is not None:
        parts.append(f"above {low}" if open_low else f"at least {low}")
    if high is not None:
        parts.append(f"below {high}" if open_high else f"at most {high}")
    raise OmniDraftError(f"{flag} must be {' and '.join(parts)} (got {value})")


def check_choice(flag: str, value: str, choices) -> None:
    """Raise a one-line OmniDraftError unless value is one of choices."""
    if value not in choices:
        choices = list(choices)
        use = " or ".join(choices) if len(choices) <= 2 else "one of " + ", ".join(choices)
        raise OmniDraftError(f"unknown {flag} '{value}': use {use}")
