"""What a pair keeps on disk between runs: atomic, durable writes (atomic), the
contract of a learned part and SIGINT/SIGTERM deferral (learned), which weights a
model directory holds (digest), and the profile that loads, merges and saves the
parts under a lock shared by processes (store), and the drafter's adapter (adapter:
its LoRA layers, weights and fusing, which learn/ trains). atomic and learned import
only the standard library and errors, so the parts' packages may use them; store
imports the n-gram cache (the part every profile has) but not the parts its callers
attach (the policy's head, the history index: handed in), nor learn/ or decode/.
May import: vocab.ngram, paths, failpoints, errors.
"""
