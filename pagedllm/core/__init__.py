"""Pure-Python core: requests, KV blocks, scheduling. Nothing here imports torch."""
