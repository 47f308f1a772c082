"""What a pair keeps on disk between runs: atomic, durable writes (atomic), the
contract of a learned part and SIGINT/SIGTERM deferral (learned), which weights a
model directory holds (digest), and the profile that loads, merges and saves the
parts under a lock shared by processes (store). atomic and learned import only
the standard library and errors, so the parts' packages may use them; store may
import the parts (vocab.ngram), digest, and paths (where profiles live, which
weights a name stands for).
"""
