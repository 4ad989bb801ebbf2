"""core: what every other layer stands on and that knows nothing of models or builds.

Errors (one hierarchy), canonical keys and digests, lazy imports, the allocator and the
worker-thread count. Imports nothing from buildkit.
"""
