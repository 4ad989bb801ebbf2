"""engine: manifests in, artifacts out.

The Step interface and its registry (``step``), manifests (``manifest``), the DAG (``graph``),
keys and freshness (``plan``), running it locally or on Dask (``scheduler``, ``distributed``),
progress (``report``), releases and locks (``release``) and size estimates (``estimate``).
Steps are plugins, found through the ``buildkit.steps`` entry points on the registry's first
look-up: the engine never imports a step. May import every layer below it.
"""
