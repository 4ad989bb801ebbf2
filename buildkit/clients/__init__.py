"""clients: the output opened as its users open it.

Load checks through mlx_lm, mlx_vlm and oMLX's conventions (``loadcheck``); mlx_vlm's own
speculative decoding with the published drafter (``speculative``).
May import core, formats, store, fixtures, grade and quant.
"""
