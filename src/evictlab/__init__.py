"""evictlab: a reproducible experiment pipeline for KV-cache eviction research."""

__version__ = "0.1.0"
