"""The bridge between two tokenizers: byte spellings of tokens and the draft ->
target map, translation of drafted tokens, alignment of two tokenizations by
byte offsets, the online n-gram cache, and target tokens streamed as text.
May import: profile.learned, profile.atomic, errors, settings.
"""
