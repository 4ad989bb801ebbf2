"""engine: manifests in, artifacts out, knowing no model.

The Step interface and its registry (``step``), manifests (``manifest``), the DAG (``graph``),
keys and freshness (``plan``), running it locally or on Dask (``scheduler``, ``distributed``),
progress (``report``), releases, locks and release gates (``release``) and the walk that
estimates each node's output from layouts (``estimate``). Steps are plugins, found through the
``buildkit.steps`` entry points on the registry's first look-up: the engine never imports a
step, and what it asks of one goes through the step interface. May import core and store only.
"""
