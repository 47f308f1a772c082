"""Learning: the drafter distilled towards the target (reverse KL + lambda NLL,
LoRA), adaptation runs over prompts or documents, learning between replies (online:
chat's and serve's), and adaptation across processes (mx.distributed).
May import: decode, vocab, profile, pair, loading, collectives, prompts, tasks, paths, failpoints, errors, settings.
"""
