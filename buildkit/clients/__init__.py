"""clients: the output opened as its users open it.

Load checks through mlx_lm, mlx_vlm and oMLX's conventions (``loadcheck``).
May import core, formats, store, fixtures, grade and quant.
"""
