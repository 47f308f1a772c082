"""User-facing errors: one line saying what is wrong and what to do."""


class OmniDraftError(Exception):
    """An error the CLI prints as one line (no traceback) and exits non-zero on."""
