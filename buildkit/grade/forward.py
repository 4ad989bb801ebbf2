"""The forward pass: mlx_lm's ``qwen3_5_moe`` classes run one decoder layer in memory at a time,
in float32 (mlx on CPU has no bf16 ``gather_mm``), their linears as numpy matmuls (mlx's CPU
matmul is 10-20x slower than OpenBLAS). calibrate, sensitivity, the reference and eval all run
their layers here. A layer's routed experts are either read whole (``whole_layer``: sensitivity,
which swaps them) or streamed (``streamed_layer``: calibrate, eval and the reference, at the
real model's size).

Streamed, nothing vocabulary- or expert-stack-sized is ever widened whole (the real embedding and
lm_head are 248320 x 2048, each layer's experts 256 x 3 x 512 x 2048):

- the embedding: only the rows of the tokens the text uses are kept as its blocks pass;
- a decoder layer: its attention, router and shared expert loaded as mlx_lm's modules, their
  linears as float32 numpy matmuls (``calibration``: mlx's CPU matmul is 10-20x slower than
  OpenBLAS), and the attention's arithmetic between them in numpy too (``attention``), a few
  sequences a part, two parts at once; the MoE runs once over every position of every batch,
  its routed experts read a block at a time (only those a position is routed to are widened
  or dequantized), on two threads;
- the output head: both models' lm_head in the same blocks of vocabulary rows, their logits
  for every position reduced block by block (``HeadScan``): a running log-sum-exp of each, the
  KL divergence in its streaming form, argmax and the next token's logit.

Memory is a block of rows (``BLOCK_BYTES`` of float32), a layer's small modules and the hidden
states; blocks are read (and checked against their digests) in the calling thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields

from buildkit.core import workers
from buildkit.core.errors import SourceError
from buildkit.core.lazy import lazy
from buildkit.formats.checkpoint import LAYERS, PROJS, SWITCH
from buildkit.formats.tensors import dequantize, picked_rows, to_float32, to_mlx
from buildkit.grade import attention

np = lazy("numpy", __name__)

BLOCK_BYTES = 8 << 20  # float32 bytes of a block of rows once widened
INFLIGHT_BYTES = 64 << 20  # a block's expert inputs and outputs, float32, in a window
FLOATS = ("BF16", "F16", "F32")
EMBED = "language_model.model.embed_tokens"
LM_HEAD = "language_model.lm_head"


# ---- weights in blocks of rows ---------------------------------------------------------


def quantization(w, module: str) -> dict | None:
    """mlx_lm's choice for a module: its per-path entry, else the defaults if it has scales."""
    q = w.quantization
    if not q:
        return None
    if isinstance(q.get(module), dict):
        return q[module]
    if f"{module}.scales" in w.names:
        return {k: q[k] for k in ("group_size", "bits", "mode") if k in q}
    return None


def _parts(w, module: str) -> tuple[list[str], dict | None]:
    q = quantization(w, module)
    names = [f"{module}.weight"]
    if q is not None:
        names += [n for n in (f"{module}.scales", f"{module}.biases") if n in w.names]
    return names, q


def row_width(w, module: str) -> int:
    """Elements in one row of the module's weight, dequantized (its input size for a linear)."""
    names, q = _parts(w, module)
    shape = w.shapes[names[0]]
    n = int(np.prod(shape[1:]))
    return n * 32 // q.get("bits", 4) if q is not None else n


def rows_per_block(w, module: str) -> int:
    return max(1, BLOCK_BYTES // (4 * row_width(w, module)))


def raw_blocks(w, module: str, step: int, pick: np.ndarray | None = None) -> Iterator[tuple]:
    """(first row, stored arrays of rows ``[a, a + step)``) of a module's weight (and scales
    and biases), read as they lie; with ``pick`` (sorted row ids), only those rows are kept and
    a block none of them falls in is not handed out (a stored one is read to be checked, a
    source file's is not read, a candidate's rows are made only where picked:
    ``Weights.iter_rows``)."""
    names, _ = _parts(w, module)
    a = 0
    for parts in zip(*(w.iter_rows(n, step, pick) for n in names), strict=True):
        b = a + parts[0].shape[0]
        if pick is None:
            yield a, parts
        else:
            sel = picked_rows(pick, a, b - a)
            if len(sel) == b - a:  # every row kept: the block as read, not a copy of it
                yield a, parts, sel
            elif len(sel):
                yield a, tuple(p[sel] for p in parts), sel
        a = b


def widen(w, module: str, parts: tuple) -> np.ndarray:
    """Stored rows of a module's weight as float32: widened, or dequantized as mlx_lm does
    (affine in numpy, other modes with mlx)."""
    names, q = _parts(w, module)
    if q is None:
        return to_float32(parts[0], w.names[names[0]])
    bits, group, mode = q.get("bits", 4), q.get("group_size", 64), q.get("mode", "affine")
    scales = to_float32(parts[1], w.names[names[1]])
    if mode == "affine" and len(parts) == 3:
        return dequantize(parts[0], scales, to_float32(parts[2], w.names[names[2]]), bits, group)
    import mlx.core as mx

    biases = mx.array(to_float32(parts[2], w.names[names[2]])) if len(parts) == 3 else None
    out = mx.dequantize(
        mx.array(parts[0]), mx.array(scales), biases, group_size=group, bits=bits, mode=mode
    )
    return np.array(out.astype(mx.float32))


def embeddings(w, ids: np.ndarray) -> np.ndarray:
    """The embedding rows of token ids (any shape) as float32 [..., H], the table streamed."""
    ids = np.asarray(ids)
    uniq, inv = np.unique(ids, return_inverse=True)
    table = np.empty((len(uniq), row_width(w, EMBED)), np.float32)
    at = 0
    for _a, parts, sel in raw_blocks(w, EMBED, rows_per_block(w, EMBED), uniq):
        table[at : at + len(sel)] = widen(w, EMBED, parts)
        at += len(sel)
    return table[inv.reshape(ids.shape)]


# ---- a decoder layer -------------------------------------------------------------------


def quantize_as_loaded(module, w, prefix: str) -> None:
    """nn.quantize with mlx_lm's predicate: a per-path entry of config["quantization"], else
    its defaults for a module whose ``.scales`` are stored; others stay unquantized."""
    import mlx.nn as nn

    q = w.quantization
    if not q:
        return
    default = {k: q[k] for k in ("group_size", "bits", "mode") if k in q}

    def predicate(path, m):
        path = prefix + path
        if isinstance(q.get(path), dict):
            return q[path]
        return hasattr(m, "to_quantized") and f"{path}.scales" in w.names and default

    nn.quantize(
        module,
        group_size=default.get("group_size", 64),
        bits=default.get("bits", 4),
        mode=default.get("mode", "affine"),
        class_predicate=predicate,
    )


def layer_mask(layer, h):
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    return create_ssm_mask(h, None) if layer.is_linear else create_attention_mask(h, None)


def _np_linear():
    import mlx.core as mx
    import mlx.nn as nn

    class NpLinear(nn.Module):
        """``x @ W.T`` with a float32 numpy W [out, in] (qwen3_5_moe's linears have no bias)."""

        def __init__(self, weight: np.ndarray):
            super().__init__()
            self.w = weight
            self.made = None  # the next call's output, made ahead on another thread

        def __call__(self, x):
            made, self.made = self.made, None
            return mx.array(made if made is not None else self.matmul(np.asarray(x, np.float32)))

        def matmul(self, a: np.ndarray) -> np.ndarray:
            """The linear over numpy rows a [..., in] (``attention`` calls it directly)."""
            return (a.reshape(-1, a.shape[-1]) @ self.w.T).reshape(*a.shape[:-1], -1)

    return NpLinear


def np_linear(weight: np.ndarray):
    """A bias-free linear ``x @ W.T`` over a float32 numpy W [out, in]."""
    return _np_linear()(weight)


def linears_to_numpy(module) -> None:
    """Swap a module's bias-free linears, quantized or not, for numpy matmuls of their float32
    weights (a quantized one dequantized once, as mlx_lm's kernel would per call)."""
    import mlx.nn as nn

    NpLinear = _np_linear()
    for path, m in module.named_modules():
        if "bias" in m or not isinstance(m, (nn.Linear, nn.QuantizedLinear)):
            continue
        if isinstance(m, nn.QuantizedLinear):
            biases = getattr(m, "biases", None)
            if m.mode == "affine" and biases is not None:
                w = dequantize(
                    np.array(m.weight),
                    np.array(m.scales),
                    np.array(biases),
                    m.bits,
                    m.group_size,
                )
            else:
                import mlx.core as mx

                w = np.array(
                    mx.dequantize(
                        m.weight,
                        m.scales,
                        biases,
                        group_size=m.group_size,
                        bits=m.bits,
                        mode=m.mode,
                    )
                )
        else:
            w = np.array(m.weight)
        parent, _, name = path.rpartition(".")
        owner = module
        for part in filter(None, parent.split(".")):
            owner = owner[int(part)] if isinstance(owner, list) else getattr(owner, part)
        setattr(owner, name, NpLinear(np.ascontiguousarray(w, np.float32)))


def _switch_class():
    import mlx.core as mx
    import mlx.nn as nn

    class StreamedSwitchGLU(nn.Module):
        """mlx_lm's SwitchGLU (``down(silu(gate x) * up x)`` per chosen expert, out [..., k, H])
        with the experts read from the weights a block at a time: only experts some row is
        routed to are widened, each over its own rows, blocks on two threads."""

        def __init__(self, w, prefix: str):
            super().__init__()
            self._w, self._prefix = w, prefix

        def __call__(self, x, indices, **kw):
            idx = np.asarray(indices)
            out = np.empty((idx.size, x.shape[-1]), np.float32)

            def put(rows, y):
                out[rows] = y

            expert_outputs(self._w, self._prefix, x, indices, put)
            return mx.array(out.reshape(*x.shape[:-1], idx.shape[-1], -1))

        def weighted(self, x, indices, scores, observe=None) -> np.ndarray:
            """sum_j scores[:, j] * expert_j(x) [N, H], as SparseMoeBlock sums the k outputs,
            added up expert by expert (in the order of their ids) as they are made: memory is
            the [N, H] sum, not the [N, k, H] outputs (0.5 GB at 35B's 2048 wide over 8k
            tokens)."""
            s = np.asarray(scores, dtype=np.float32).reshape(-1)
            k = np.asarray(indices).shape[-1]
            acc = np.zeros((s.size // k, x.shape[-1]), np.float32)

            def add(rows, y):  # an expert's rows are distinct tokens: no index repeats
                acc[rows // k] += y

            expert_outputs(self._w, self._prefix, x, indices, add, observe, scale=s)
            return acc

    return StreamedSwitchGLU


def expert_outputs(w, p: str, x, indices, sink, observe=None, scale=None) -> None:
    """The streamed switch's work (``p`` its prefix in ``w``): each (row, choice)'s expert
    output, handed to ``sink(rows, y)`` ([len(rows), H] float32, rows ids into the flattened
    [N * k] choices) in the calling thread, expert by expert in the order of their ids; with
    ``scale`` ([N * k]), each output times its choice's scale, multiplied on the worker (the
    calling thread reads every block and sums: it is the one that keeps the others waiting).
    ``observe(e, rows, x, mid)``, if given, sees each expert's rows (ids into x, ascending),
    their inputs and intermediate activations ``silu(gate x) * up x`` (on either thread: an
    observer writes only expert e's own state)."""
    a = np.asarray(x, dtype=np.float32)
    xs = a.reshape(-1, a.shape[-1])
    idx = np.asarray(indices).reshape(xs.shape[0], -1)
    k = idx.shape[1]
    order = np.argsort(idx.reshape(-1), kind="stable")
    n_experts = w.shapes[f"{p}.down_proj.weight"][0]
    counts = np.bincount(idx.reshape(-1), minlength=n_experts)
    starts = np.concatenate([[0], np.cumsum(counts)])
    projs = [f"{p}.{q}" for q in ("gate_proj", "up_proj", "down_proj")]
    step = min(rows_per_block(w, m) for m in projs)
    active = np.flatnonzero(counts)

    def blocks():
        streams = [raw_blocks(w, m, step, active) for m in projs]
        for got in zip(*streams, strict=True):
            yield got[0][0], got[0][2], [g[1] for g in got]

    def run(item):
        a0, sel, raw = item
        gate, up, down = (widen(w, m, r) for m, r in zip(projs, raw, strict=True))
        made = []
        for i, e in enumerate(sel + a0):
            rows = order[starts[e] : starts[e + 1]]
            xe = xs[rows // k]
            g, u = (gate[i] @ xe.T).T, (up[i] @ xe.T).T
            mid = (g / (1.0 + np.exp(-g))) * u
            y = mid @ down[i].T
            made.append((rows, y if scale is None else y * scale[rows, None]))
            if observe is not None:
                observe(e, rows // k, xe, mid)
        return made

    # a block's outputs wait in the window until sunk: where routing crowds many rows onto a
    # block's experts (all of them, on the sparse source), fewer blocks are let in flight
    crowd = np.add.reduceat(counts, np.arange(0, n_experts, step)).max() * 8 * a.shape[-1]
    window = int(np.clip(INFLIGHT_BYTES // max(crowd, 1), 2, 4))
    for made in workers.imap("eval", run, blocks(), window=window):
        for rows, y in made:
            sink(rows, y)


def streamed_switch(w, prefix: str):
    """A layer's routed experts under ``prefix`` (``…mlp.switch_mlp``), streamed from ``w``."""
    return _switch_class()(w, prefix)


def load_module(module, w, prefix: str, skip: str = "\0") -> None:
    """Load a module's tensors under ``prefix`` (floating ones widened to float32), but those
    under ``skip``."""
    import mlx.core as mx

    arrays = []
    for name in sorted(n for n in w.names if n.startswith(prefix) and not n.startswith(skip)):
        a = to_mlx(w.read(name), w.names[name])
        arrays.append((name[len(prefix) :], a.astype(mx.float32) if w.names[name] in FLOATS else a))
    module.load_weights(arrays, strict=True)
    mx.eval(module.parameters())


def streamed_layer(w, prefix: str, args, index: int):
    """mlx_lm's DecoderLayer ``index`` of ``args``, weights under ``prefix`` (ending in "."):
    its small modules loaded (quantized as mlx_lm.load quantizes them, then their linears as
    numpy matmuls), its routed experts left in ``w`` to be streamed."""
    from mlx_lm.models.qwen3_5 import DecoderLayer

    layer = DecoderLayer(args, index)
    switch = prefix + "mlp.switch_mlp"
    layer.mlp.switch_mlp = streamed_switch(w, switch)
    quantize_as_loaded(layer, w, prefix)
    load_module(layer, w, prefix, skip=switch + ".")
    linears_to_numpy(layer)
    return layer


def run_streamed(layer, hs: list, parts: dict | None = None) -> list:
    """The layer over each batch of hidden states [B, L, H] (whole sequences, no cache): the
    attention per batch, then the MoE once over every position (it is position-wise), so the
    experts are read once. ``parts``, if given, gets what a variant of the layer that changes
    only its MoE may reuse: ``mid`` (each batch after the attention), the MoE's input ``x``
    [N, H], its routing ``inds`` and ``scores``, and the routed experts' sum ``routed``."""
    import mlx.core as mx

    mid = attend(layer, hs)
    x = layer.post_attention_layernorm(mx.concatenate([m.reshape(-1, m.shape[-1]) for m in mid]))
    inds, scores = route(layer.mlp, x)
    shared = shared_started(layer.mlp, x)
    routed = routed_sum(layer.mlp.switch_mlp, x, inds, scores)
    if parts is not None:
        parts.update(mid=mid, x=x, inds=inds, scores=scores, routed=routed)
    return residual(mid, shared(routed))


# positions through a layer's attention at once: its numpy linears run faster over more rows
# than a 128-token window's (bench/RESULTS.md), and its memory is a few times this x 8192 floats
ATTEND_POSITIONS = 512


def attend(layer, hs: list) -> list:
    """The attention half of a decoder layer, its residual added, over each batch [B, L, H]
    (a few sequences at a time, at most ``ATTEND_POSITIONS`` positions unless one is longer).
    In numpy the parts run on two threads: one thread's matmuls left a core idle, and the
    attention is most of a layer's time at the 35B shapes (bench/RESULTS.md)."""
    import mlx.core as mx

    attn = layer.linear_attn if layer.is_linear else layer.self_attn
    mx.eval(attn.parameters())  # the threads read its weights as they are, computing nothing
    mid = []
    with attention.in_numpy():
        for h in hs:
            step = max(1, ATTEND_POSITIONS // h.shape[1])
            fast = attention.numpy_call(attn, layer_mask(layer, h))
            if fast is None or h.dtype != mx.float32:
                rows = []
                for r in range(0, h.shape[0], step):
                    x = h[r : r + step]
                    rows.append(x + attn(layer.input_layernorm(x), layer_mask(layer, x), None))
                    mx.eval(rows[-1])
            else:  # the norm in mlx as before (the same bytes), the rest a part a thread
                n = layer.input_layernorm(h)
                mx.eval(n)
                x, n = np.asarray(h), np.asarray(n)
                parts = [(x[r : r + step], n[r : r + step]) for r in range(0, h.shape[0], step)]
                added = workers.imap("attend", lambda p, f=fast: p[0] + f(p[1]), parts)
                rows = [mx.array(y) for y in added]
            mid.append(mx.concatenate(rows) if len(rows) > 1 else rows[0])
    return mid


def residual(mid: list, y) -> list:
    """Each batch of ``mid`` [B, L, H] plus its rows of the MoE's output y [N, H]."""
    import mlx.core as mx

    out, at = [], 0
    for m in mid:
        n = m.shape[0] * m.shape[1]
        out.append(m + y[at : at + n].reshape(m.shape))
        at += n
    mx.eval(out)
    return out


def route(mlp, x):
    """mlx_lm's SparseMoeBlock router on x [N, H]: each row's top-k experts and their scores."""
    import mlx.core as mx

    gates = mx.softmax(mlp.gate(x), axis=-1, precise=True)
    k = mlp.top_k
    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if mlp.norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    mx.eval(inds, scores)
    return inds, scores


def mix(mlp, x, inds, scores, observe=None):
    """The MoE's output for rows x routed to ``inds`` with ``scores``: the routed experts'
    weighted sum (``observe``: the switch's) plus the gated shared expert."""
    return shared_added(mlp, x, routed_sum(mlp.switch_mlp, x, inds, scores, observe))


def routed_sum(switch, x, inds, scores, observe=None):
    """The routed experts' weighted sum [N, H], made in numpy by a streamed switch."""
    import mlx.core as mx

    return mx.array(switch.weighted(x, inds, scores, observe))


def shared_added(mlp, x, routed):
    """SparseMoeBlock's output: the routed experts' sum plus the gated shared expert of x."""
    import mlx.core as mx

    return routed + mx.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)


def shared_started(mlp, x):
    """``shared_added`` begun: the shared expert's gate and up projections and its gate's, numpy
    matmuls on a thread of their own while the routed experts run (where routing leaves the
    experts' threads idle while a layer's blocks are read, as on the sparse source, it fills
    them); returns what finishes it given the routed sum, the same bytes as ``shared_added``."""
    se = mlp.shared_expert
    ahead = [se.gate_proj, se.up_proj, mlp.shared_expert_gate]
    if not all(hasattr(p, "made") for p in ahead):
        return lambda routed: shared_added(mlp, x, routed)
    xn = np.asarray(x, dtype=np.float32)
    made = workers.pool("shared").submit(lambda: [p.matmul(xn) for p in ahead], workers=1)

    def finish(routed):
        for p, y in zip(ahead, made.result(), strict=True):
            p.made = y
        return shared_added(mlp, x, routed)

    return finish


def _whole_switch_class():
    import mlx.core as mx
    import mlx.nn as nn

    class WholeSwitchGLU(nn.Module):
        """mlx_lm's SwitchGLU (``down(silu(gate x) * up x)`` for each chosen expert, output
        [..., k, H]) one expert at a time over the rows routed to it, the experts held whole
        in float32 (sensitivity's candidates swap them)."""

        def __init__(self, gate_up: np.ndarray, down: np.ndarray):
            super().__init__()
            self.gate_up = gate_up  # [E, 2I, H]: one matmul for both
            self.down = down

        def __call__(self, x, indices, **kw):
            a = np.asarray(x)
            xs = a.reshape(-1, a.shape[-1])
            idx = np.asarray(indices).reshape(xs.shape[0], -1)
            k, n_experts = idx.shape[-1], self.down.shape[0]
            y = np.empty((*idx.shape, xs.shape[-1]), np.float32)
            order = np.argsort(idx.reshape(-1), kind="stable")
            counts = np.bincount(idx.reshape(-1), minlength=n_experts)
            inter = self.down.shape[-1]
            starts = np.concatenate([[0], np.cumsum(counts)])
            out = y.reshape(-1, xs.shape[-1])

            def run(experts):
                for e in experts:
                    rows = order[starts[e] : starts[e + 1]]
                    gu = mm(self.gate_up[e], xs[rows // k])
                    out[rows] = mm(self.down[e], silu(gu[:, :inter]) * gu[:, inter:])

            # on two threads (numpy's matmuls release the GIL), experts alternating: each
            # expert's rows of y are its own, so the bytes are one thread's
            active = np.flatnonzero(counts)
            for _ in workers.imap("calibrate", run, [active[0::2], active[1::2]]):
                pass
            return mx.array(y.reshape(*a.shape[:-1], k, -1))

    return WholeSwitchGLU


def silu(g: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-g))


def mm(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for a weight w [out, in] and a few rows x [n, in], computed as ``(w @ x.T).T``:
    OpenBLAS's sgemm runs that shape faster at a few rows, with the same bytes here
    (bench/RESULTS.md)."""
    return (w @ x.T).T


def whole_switch(gate_up: np.ndarray, down: np.ndarray):
    """The experts module over float32 gate and up [E, 2I, H] and down [E, H, I], held whole."""
    return _whole_switch_class()(gate_up, down)


def whole_experts(w, switch: str) -> tuple[np.ndarray, np.ndarray]:
    """A layer's routed experts in float32, gate and up in one [E, 2I, H] array: read straight
    to numpy, not through mlx and a concatenation, so one copy of them in memory."""
    names = {p: f"{switch}.{p}.weight" for p in PROJS}
    E, inter, hidden = w.shapes[names["gate_proj"]]
    gate_up = np.empty((E, 2 * inter, hidden), np.float32)
    for half, p in enumerate(("gate_proj", "up_proj")):
        gate_up[:, half * inter : (half + 1) * inter] = to_float32(
            w.read(names[p]), w.names[names[p]]
        )
    return gate_up, to_float32(w.read(names["down_proj"]), w.names[names["down_proj"]])


def whole_layer(w, i: int, args):
    """Decoder layer ``i`` of a bf16 model with its routed experts read whole
    (``whole_switch``) and its other linears as numpy matmuls."""
    from mlx_lm.models.qwen3_5 import DecoderLayer

    layer = DecoderLayer(args, i)
    prefix = f"{LAYERS}{i}"
    layer.mlp.switch_mlp = whole_switch(*whole_experts(w, prefix + SWITCH))
    load_module(layer, w, prefix + ".", skip=prefix + SWITCH + ".")
    linears_to_numpy(layer)
    return layer


# ---- a model's pass over windows of text -------------------------------------------------


def build_model(config: dict):
    """mlx_lm's qwen3_5_moe Model for a checkpoint config (weights not loaded; mlx is lazy,
    so nothing is allocated until a layer's weights are loaded)."""
    from mlx_lm.models import qwen3_5_moe

    if config.get("model_type") != "qwen3_5_moe":
        raise SourceError(
            "the forward pass runs qwen3_5_moe checkpoints; config.json has model_type "
            f"{config.get('model_type')!r}"
        )
    return qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))


def text_args(w):
    """The text model's ModelArgs of ``w``'s config (what DecoderLayer takes)."""
    return build_model(w.config).language_model.args


@dataclass
class Trunk:
    """One model's pass over the text: per batch of sequences, the embeddings x0 and the last
    decoder layer's output h (before the final norm), float32 [B, L, H]; per sequence its
    argmax per position; and per batch the text it is from ("" the main one, else a domain)."""

    x0: list = field(default_factory=list)
    h: list = field(default_factory=list)
    argmax: list = field(default_factory=list)
    groups: list = field(default_factory=list)


def rows(seqs: list[np.ndarray]):
    """(batch index, row, token ids [L]) of every sequence: logits are made one sequence at a
    time (the real vocabulary makes a batch's logits gigabytes)."""
    return [(j, r, b[r]) for j, b in enumerate(seqs) for r in range(b.shape[0])]


def run_layer(layer, hs: list) -> list:
    """One decoder layer over each batch of hidden states (no cache: whole sequences)."""
    import mlx.core as mx

    with attention.in_numpy():
        out = [layer(h, mask=layer_mask(layer, h), cache=None) for h in hs]
        mx.eval(out)
    return out


# positions through the decoder layers at once: the MoE's arrays are a few of this x H floats,
# and each part reads the experts again (at 35B ~15 s a pass: a long text costs that per part)
TRUNK_POSITIONS = 2048


def run_trunk(w, seqs: list[np.ndarray], progress=None) -> Trunk:
    """Every layer over every batch of ``seqs`` ([B, L] token ids), one layer's small modules
    in memory, its experts and the embedding streamed; the rows in parts of at most
    ``TRUNK_POSITIONS`` positions (one window if longer), each through every layer, so that
    memory does not grow with the text."""
    import mlx.core as mx

    from buildkit.core.allocator import tune_imported

    tune_imported()  # freed layers go back to malloc, not to a second reserve in mlx
    args = text_args(w)
    parts = row_parts(seqs, TRUNK_POSITIONS)
    if progress and len(parts) > 1:
        progress.grow((len(parts) - 1) * args.num_hidden_layers)
    x0, h = [[] for _ in seqs], [[] for _ in seqs]
    for part in parts:
        hp = [mx.array(embeddings(w, seqs[j][a:b])) for j, a, b in part]
        for (j, _, _), x in zip(part, hp, strict=True):
            x0[j].append(x)
        w.prefetch(f"{LAYERS}0.")
        made = _layer_ahead(w, args, 0)
        for i in range(args.num_hidden_layers):
            # the next layer's bytes (the head's, after the last) read, and its small modules
            # loaded, while this one runs: two layers' small modules are held at a time
            last = i + 1 == args.num_hidden_layers
            w.prefetch(head_module(w) if last else f"{LAYERS}{i + 1}.")
            layer, made = made.result(), None if last else _layer_ahead(w, args, i + 1)
            hp = run_streamed(layer, hp)
            del layer  # free this layer's weights before loading the next
            if progress:
                progress.advance(1)
        for (j, _, _), x in zip(part, hp, strict=True):
            h[j].append(x)
    return Trunk([joined(x) for x in x0], [joined(x) for x in h])


def _layer_ahead(w, args, i: int):
    """Layer ``i`` made by ``streamed_layer`` on a thread of its own (its future)."""
    return workers.pool("layers").submit(streamed_layer, w, f"{LAYERS}{i}.", args, i, workers=1)


def joined(pieces: list):
    """A batch from its consecutive row slices."""
    import mlx.core as mx

    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)


def row_parts(seqs: list[np.ndarray], limit: int) -> list[list[tuple[int, int, int]]]:
    """The rows of ``seqs`` in order as parts of (batch, first row, end row) slices, each part
    at most ``limit`` positions (a row longer than that alone)."""
    parts: list[list[tuple[int, int, int]]] = [[]]
    room = limit
    for j, b in enumerate(seqs):
        for r in range(b.shape[0]):
            if b.shape[1] > room and parts[-1]:
                parts.append([])
                room = limit
            last = parts[-1][-1] if parts[-1] else None
            if last and last[0] == j and last[2] == r:
                parts[-1][-1] = (j, last[1], r + 1)
            else:
                parts[-1].append((j, r, r + 1))
            room -= b.shape[1]
    return parts


class Output:
    """The final norm and lm_head of a model (mlx_lm's modules, quantized as published)."""

    def __init__(self, w):
        model = build_model(w.config)
        quantize_as_loaded(model, w, "")
        self.norm, self.lm_head = model.language_model.model.norm, model.language_model.lm_head
        load_module(self.norm, w, "language_model.model.norm.")
        load_module(self.lm_head, w, "language_model.lm_head.")

    def __call__(self, h):
        return self.lm_head(self.norm(h))


def embed(w, seqs: list[np.ndarray]) -> list:
    """The embeddings [B, L, H] of each batch of token ids, float32 (mlx_lm's module)."""
    import mlx.core as mx

    model = build_model(w.config)
    quantize_as_loaded(model, w, "")
    module = model.language_model.model.embed_tokens
    load_module(module, w, "language_model.model.embed_tokens.")
    x0 = [module(mx.array(s)) for s in seqs]
    mx.eval(x0)
    return x0


def np_logprobs(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of logits [..., V] in numpy (float32; mlx's CPU exp is slower)."""
    m = logits.max(axis=-1, keepdims=True)
    return logits - (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))


# ---- the output head, streamed over the vocabulary --------------------------------------


def final_norm(w, hs: list) -> np.ndarray:
    """The final norm of hidden states [B, L, H] (each batch's rows in order) as [N, H]."""
    import mlx.core as mx
    import mlx.nn as nn

    H = hs[0].shape[-1]
    norm = nn.RMSNorm(H)
    load_module(norm, w, "language_model.model.norm.", skip="\0")
    out = [np.array(norm(h)).reshape(-1, H) for h in hs]
    mx.eval(norm.parameters())
    return np.concatenate(out)


def head_module(w) -> str:
    """The output head's module: lm_head, or the embedding where the config ties them."""
    return LM_HEAD if f"{LM_HEAD}.weight" in w.names else EMBED


class HeadScan:
    """Per position, over the whole vocabulary, of models' logits ``h @ W.T``: log-sum-exp,
    argmax, the logit of a target token and, of each model j after the first, KL(p_0 || p_j),
    in one pass over the heads' blocks of rows. KL = E_p0[a - b] - lse(a) + lse(b) with a, b
    the logits; E_p0[a - b] is summed block by block, rescaled as the running max of a moves.
    Each model's figures are the bytes a scan of model 0 and it alone gives (its own matmul and
    reductions over the same blocks): several share model 0's logits, made once.

    For ``HeadSummary``, of model 0: ``top`` its highest logits and their ids, ``mean`` its
    rows weighted by p_0; ``at`` [N, K] ids whose logits it gives too, with ``diff`` [N, H]
    (float64) the product ``diff . W_v`` at each."""

    def __init__(
        self,
        ws: list,
        hns: list[np.ndarray],
        targets: np.ndarray | None = None,
        *,
        top: int = 0,
        mean: bool = False,
        at: np.ndarray | None = None,
        diff: np.ndarray | None = None,
    ):
        self.ws, self.hns, self.targets = ws, hns, targets
        n = hns[0].shape[0]
        self.m = [np.full(n, -np.inf) for _ in ws]  # running max (float64)
        self.s = [np.zeros(n) for _ in ws]  # sum exp(logit - m)
        self.arg = [np.zeros(n, np.int64) for _ in ws]
        self.tgt = [np.full(n, np.nan) for _ in ws]
        self.t = [np.zeros(n) for _ in ws[1:]]  # model j's sum exp(a - m_0) (a - b_j)
        self.at_ref = [np.full(n, -np.inf) for _ in ws[1:]]  # model j's at model 0's argmax
        top = min(top, ws[0].shapes[f"{head_module(ws[0])}.weight"][0])  # not past the vocabulary
        self.top_v = np.full((n, top), -np.inf, np.float32)
        self.top_i = np.zeros((n, top), np.int64)
        # model 0's sum exp(a - m_0) W_v over the rows v, rescaled as s is
        self.mean = np.zeros(hns[0].shape, np.float64) if mean else None
        self.at, self.diff = at, diff
        self.at_logit = None if at is None else np.full(at.shape, np.nan, np.float32)
        self.at_diff = None if at is None else np.zeros(at.shape)
        self.run()

    def run(self) -> None:
        mods = [head_module(w) for w in self.ws]
        step = min(rows_per_block(w, m) for w, m in zip(self.ws, mods, strict=True))
        # a block's logits, positions x rows floats, at most a weight block's bytes: many
        # positions (a long text) take narrower blocks, not more memory
        step = max(64, min(step, BLOCK_BYTES // (4 * max(len(self.m[0]), 1))))
        # one head given twice (two hidden states through it) is read and widened once
        first: dict[tuple, int] = {}
        src = [
            first.setdefault((id(w), m), i)
            for i, (w, m) in enumerate(zip(self.ws, mods, strict=True))
        ]
        heads = sorted(set(src))
        streams = [raw_blocks(self.ws[i], mods[i], step) for i in heads]

        def logits(item):
            W = {
                i: widen(self.ws[i], mods[i], raw) for i, (_, raw) in zip(heads, item, strict=True)
            }
            ls = [hn @ W[i].T for hn, i in zip(self.hns, src, strict=True)]
            mean = None
            if self.mean is not None:  # the block's rows weighted by exp(a - its own max)
                top = ls[0].max(axis=1)
                mean = np.exp(ls[0] - top[:, None]) @ W[0], top.astype(np.float64)
            return item[0][0], ls, W[0] if self.at is not None else None, mean

        for got in workers.imap("eval", logits, zip(*streams, strict=True), window=3):
            self.add(*got)

    def add(self, a: int, ls: list[np.ndarray], w0=None, mean: tuple | None = None) -> None:
        """One block of rows from ``a``: each model's logits ``ls`` (``w0``: model 0's rows,
        for ``at``; ``mean``: its rows weighted within the block, and the block's max)."""
        rows = np.arange(len(self.m[0]))
        for i, lg in enumerate(ls):
            top = lg.argmax(axis=1)
            mx_ = lg[rows, top].astype(np.float64)
            new = np.maximum(self.m[i], mx_)
            scale = np.exp(self.m[i] - new)
            e = np.exp(lg - new[:, None].astype(np.float32))
            self.s[i] = self.s[i] * scale + e.sum(axis=1, dtype=np.float64)
            if i == 0:
                up = mx_ > self.m[0]
                for j, b in enumerate(ls[1:]):
                    self.t[j] = self.t[j] * scale + (e * (lg - b)).sum(axis=1, dtype=np.float64)
                    # for delta p: model j's logit where model 0 tops
                    self.at_ref[j] = np.where(up, b[rows, top].astype(np.float64), self.at_ref[j])
                if mean is not None:
                    moved = scale < 1  # most blocks move no position's running max
                    self.mean[moved] *= scale[moved, None]
                    self.mean += mean[0] * np.exp(mean[1] - new)[:, None]
                self._keep_top(a, lg)
                self._at(a, lg, w0)
            self.arg[i] = np.where(mx_ > self.m[i], top + a, self.arg[i])
            self.m[i] = new
            if self.targets is not None:
                inside = (self.targets >= a) & (self.targets < a + lg.shape[1])
                self.tgt[i][inside] = lg[rows[inside], self.targets[inside] - a]

    def _keep_top(self, a: int, lg: np.ndarray) -> None:
        """Model 0's ``top`` highest logits so far and their ids, in no order: the positions
        with a logit in this block above their lowest kept one take the block's best."""
        k = self.top_v.shape[1]
        if not k:
            return
        hit = np.flatnonzero((lg > self.top_v.min(axis=1)[:, None]).any(axis=1))
        if not hit.size:
            return
        v = np.concatenate([self.top_v[hit], lg[hit]], axis=1)
        ids = np.concatenate(
            [self.top_i[hit], np.broadcast_to(a + np.arange(lg.shape[1]), (hit.size, lg.shape[1]))],
            axis=1,
        )
        keep = np.argpartition(-v, k - 1, axis=1)[:, :k]  # v: the k kept and the block's
        self.top_v[hit] = np.take_along_axis(v, keep, axis=1)
        self.top_i[hit] = np.take_along_axis(ids, keep, axis=1)

    def _at(self, a: int, lg: np.ndarray, w: np.ndarray | None) -> None:
        """Model 0's logits at the ``at`` ids in this block, and ``diff . W_v`` there."""
        if self.at is None:
            return
        r, c = np.nonzero((self.at >= a) & (self.at < a + lg.shape[1]))
        v = self.at[r, c] - a
        self.at_logit[r, c] = lg[r, v]
        if self.diff is not None:
            for x in range(0, len(r), 4096):  # [pairs, H] float64 at a time: a few MB
                p = slice(x, x + 4096)
                self.at_diff[r[p], c[p]] = np.einsum(
                    "ij,ij->i", self.diff[r[p]], w[v[p]].astype(np.float64)
                )

    def lse(self, i: int) -> np.ndarray:
        return self.m[i] + np.log(self.s[i])

    def kl(self, j: int = 1) -> np.ndarray:
        """KL(p_0 || p_j) per position, float rounding below zero clipped."""
        return np.maximum(self.t[j - 1] / self.s[0] - self.lse(0) + self.lse(j), 0.0)

    def delta_p(self, j: int = 1) -> np.ndarray:
        """p_j - p_0 of the token model 0 ranks first (llama.cpp's delta p), per position."""
        return np.exp(self.at_ref[j - 1] - self.lse(j)) - np.exp(self.m[0] - self.lse(0))

    def nll(self, i: int) -> np.ndarray:
        return self.lse(i) - self.tgt[i]

    def summary(self) -> HeadSummary:
        """Model 0's side of the scan (``top`` and ``mean`` given): what a model with the same
        head is graded against without model 0's logits. Its ids highest logit first, ties by
        id, so the first is the argmax."""
        order = np.lexsort((self.top_i, -self.top_v), axis=-1)
        return HeadSummary(
            lse=self.lse(0),
            tgt=self.tgt[0],
            ids=np.take_along_axis(self.top_i, order, axis=1).astype(np.int32),
            logits=np.take_along_axis(self.top_v, order, axis=1),
            mean=(self.mean / self.s[0][:, None]).astype(np.float32),
        )


SUMMARY_TOP = 32  # a summary's top logits: their share of KL is summed as a two-head scan does


@dataclass
class HeadSummary:
    """A model's output head over positions, kept so that a model whose head is byte for byte
    the same is graded without these logits [N]: log-sum-exp, the next token's logit, the
    ``SUMMARY_TOP`` highest logits and their ids [N, K] (the first the argmax), and ``mean`` =
    E_p[W], the head's rows weighted by the model's next-token distribution [N, H].

    With the same W, E_p0[a - b] = (h_0 - h_j) . E_p0[W], so KL(p_0 || p_j) takes model j's
    scan alone: its log-sum-exp and its logits at the top ids. Those correct the top ids' share
    to the float32 logits' own (a - b), as a scan of both heads sums it, so that the float32
    rounding of the log-sum-exps cancels there as it does in that scan; the tail's share is
    (h_0 - h_j) . W exactly."""

    lse: np.ndarray
    tgt: np.ndarray
    ids: np.ndarray
    logits: np.ndarray
    mean: np.ndarray

    def take(self, idx: np.ndarray) -> HeadSummary:
        return HeadSummary(*(getattr(self, f.name)[idx] for f in fields(self)))

    @staticmethod
    def join(parts: list[HeadSummary]) -> HeadSummary:
        return HeadSummary(
            *(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(HeadSummary))
        )

    @property
    def arg(self) -> np.ndarray:
        return self.ids[:, 0].astype(np.int64)

    def scan(self, w, hn: np.ndarray, h0: np.ndarray, targets=None) -> HeadScan:
        """Model ``w``'s scan on its final-normed states ``hn`` (``h0``: the summarized
        model's), with its logits and (h0 - hn) . W_v at the top ids."""
        diff = h0.astype(np.float64) - hn
        return HeadScan([w], [hn], targets, at=self.ids, diff=diff)

    def kl(self, scan: HeadScan) -> np.ndarray:
        """KL(p_0 || p_j) per position (``scan``: model j's, ``scan``), float rounding below
        zero clipped."""
        p = np.exp(self.logits - self.lse[:, None])
        a_b = self.logits.astype(np.float64) - scan.at_logit
        fix = (p * (a_b - scan.at_diff)).sum(axis=1)  # the top ids' float32 (a - b)
        d = np.einsum("nh,nh->n", scan.diff, self.mean.astype(np.float64))
        return np.maximum(d + fix - self.lse + scan.lse(0), 0.0)

    def delta_p(self, scan: HeadScan) -> np.ndarray:
        """p_j - p_0 of the token model 0 ranks first, per position (``scan``: model j's)."""
        top = self.logits[:, 0].astype(np.float64)
        return np.exp(scan.at_logit[:, 0] - scan.lse(0)) - np.exp(top - self.lse)

    def nll(self) -> np.ndarray:
        return self.lse - self.tgt
