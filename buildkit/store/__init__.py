"""store: the content-addressed store and everything that moves bytes in and out of it.

Objects and action records (``store``), artifacts (``artifact``), the on-disk fan-out
(``layout``), source-file stat caches (``sources``, ``uptodate``), durable file I/O (``fsio``),
packs written in place (``packs``) and the remote cache (``remote``).
May import core and formats.
"""
