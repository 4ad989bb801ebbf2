"""present: the figures as people read them, never the store.

The model card's Markdown (``card``), the eval tables and lines of the card, ``compare`` and
``status``, every figure with its 95% interval, and the merge of a build's eval reports
(``tables``), and ``compare --plot``'s chart (``plots``). Callers (publish, the CLI) pass in
what to show; nothing here opens a store.
May import core, formats, fixtures, grade, quant, clients and store's ``artifact`` listing.
"""
