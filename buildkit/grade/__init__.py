"""grade: running the model to measure it.

The calibration forward pass, one decoder layer at a time (``calibration``), the comparison of a
quantized model with its bf16 source (``evaluate``), the MTP head's acceptance by depth
(``drafting``) and every figure's 95% interval by a block bootstrap over windows (``stats``).
May import core, formats, store and fixtures.
"""
