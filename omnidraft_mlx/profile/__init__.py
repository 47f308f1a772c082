"""What a pair keeps on disk between runs: atomic writes (atomic), the contract
of a learned part and Ctrl-C deferral (learned), and the profile that loads,
merges and saves the parts under a lock shared by processes (store).
atomic and learned import only the standard library and errors, so the parts'
packages may use them; store may import the parts (vocab.ngram) and paths (where profiles live, which weights
a name stands for).
"""
