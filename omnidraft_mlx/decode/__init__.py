"""Decoding: the speculative loop and everything one round uses.

Draft sources (the drafter, lookups), the scheduler that picks a round's draft
and the guard, the draft-length policy and its acceptance head, verification
of chains, trees and batched rows, rollback of the models' caches, the prompt
cache, verification costs, and plain decoding (the reference).
May import: vocab, profile.learned, profile.atomic, pair, anatomy, collectives, paths, errors, settings.
"""
