"""quant: what a tensor becomes.

Roles and the recipe (``roles``), one tensor quantized by role (``quantize``), affine
quantization and its error measures (``affine``, ``qerror``), the data-aware search and its
compiled kernel (``dataaware``, ``groupsearch``), GPTQ (``gptq``) and the bit budget
(``budget``). May import core, formats, store, fixtures and grade (calibration statistics).
"""
