"""Checks for the settings dataclasses (their __post_init__ calls them), so every
verb and any other front end rejects the same bad values with the same
one-line error, named by the command-line flag that sets them."""

from __future__ import annotations

from omnidraft_mlx.errors import OmniDraftError


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
