"""buildkit: a declarative build system with content-addressed artifacts for quantized MLX models.

The package is layered; each folder may import only the folders listed before it
(``tests/test_layering.py`` enforces it from the imports):

core -> formats -> store -> fixtures -> grade -> quant -> clients -> engine -> steps -> cli
"""
