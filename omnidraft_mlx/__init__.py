"""OmniDraft-MLX: one small drafter for any target, on MLX.

The top-level modules are the ground every package stands on (errors, settings, paths,
failpoints, anatomy, prompts, tasks, blas, collectives) and what assembles the packages (pair, loading,
chat, timing); as a group they import no serve module.
May import: decode, learn, profile, vocab.
"""

__version__ = "0.1.0"
