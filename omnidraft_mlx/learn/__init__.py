"""Learning: the drafter distilled towards the target (reverse KL + lambda NLL,
LoRA), adaptation runs over prompts or documents, and adaptation across
processes (mx.distributed).
May import: decode, vocab, profile, pair, loading, prompts, tasks, paths, failpoints, errors, settings.
"""
