"""OmniDraft-MLX: one small drafter for any target, on MLX."""

__version__ = "0.1.0"
