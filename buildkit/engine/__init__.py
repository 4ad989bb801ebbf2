"""engine: manifests in, artifacts out.

The Step interface and its registry (``step``), manifests (``manifest``), the DAG (``graph``),
keys and freshness (``plan``), running it locally or on Dask (``scheduler``, ``distributed``),
progress (``report``), releases and locks (``release``) and size estimates (``estimate``).
Steps are plugins: the engine never imports ``buildkit.steps`` by name; the registry loads that
package on its first look-up. May import every layer below it.
"""
