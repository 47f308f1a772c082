"""Model catalog, pulling and GGUF conversion."""
