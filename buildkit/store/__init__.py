"""store: the content-addressed store and everything that moves bytes in and out of it.

Objects and action records (``store``), artifacts (``artifact``), the on-disk fan-out
(``layout``), source-file stat caches (``sources``, ``uptodate``), durable file I/O (``fsio``),
packs written in place (``packs``), a directory swapped in one rename (``swap``), the
remote cache (``remote``), Hugging Face Hub downloads and uploads, verified (``hub``), and a
Dask worker's own store, filled from the remote and the source by byte range (``detached``).
May import core and formats.
"""
