"""quant: what a tensor becomes.

Roles and the recipe (``roles``), one tensor quantized by role (``quantize``), affine
quantization and its error measures (``affine``, ``qerror``), the data-aware search and its
compiled kernel (``dataaware``, ``groupsearch``), GPTQ (``gptq``), the bit budget (``budget``)
and a variant's size from layouts alone (``estimate``). May import core, formats, store,
fixtures and grade (calibration statistics).
"""
