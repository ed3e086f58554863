"""Perplexity evaluation through KV caches."""
