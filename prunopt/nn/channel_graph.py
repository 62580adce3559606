"""Channel dependency graph of a traced model: which layers produce and which
consume each channel, with the channels that must be removed together grouped
(the dependency graph of Fang et al., *DepGraph: Towards Any Structural
Pruning*, CVPR 2023, arXiv:2301.12900, as Torch-Pruning builds it).

The model is traced with ``torch.export`` (when an example input is given) or
with ``torch.fx.symbolic_trace`` (without one); the layers the analysis knows
(``nn.Conv2d``, ``nn.Linear``, ``nn.BatchNorm2d`` and its
:class:`~prunopt.nn.SparseBatchNorm2d`, :class:`~prunopt.nn.FBConv2d`) are
kept as one call each, every other operation is read op by op.

Every channel of every feature map is a *slot*; operations that tie channels
together join their slots into one group (union-find):

* elementwise ops (activations, BatchNorm, residual additions, products,
  dropout, padding, pooling, spatial means) join channel ``c`` of their inputs
  and output;
* a depthwise convolution (``groups == C_in == C_out``) joins input channel
  ``c`` with output channel ``c``;
* a concatenation along the channels places each input's slots at its offset
  in the output;
* a flatten of ``(N, C, H, W)`` joins feature ``c H W + s`` with channel ``c``;
* a convolution or linear layer *reads* its input channels (a contraction: a
  channel may go only if it is zero there) and *creates* fresh output channels.

Along the way each slot records whether it is provably exactly zero: a zero
gate of a sparse BatchNorm (DS eq. 17), a convolution or linear output row
whose weights and bias are all zero, and what zero-preserving operations make
of them (``relu(0) = 0``, ``0 + 0 = 0``, ``0 * x = 0``, max-pooling of zeros).

A group can be removed when every read of it by a convolution or linear layer
sees a zero, at least one of its slots is zero, and nothing pins it: the model's
inputs and outputs (their shapes must not change), grouped convolutions
(other than depthwise), constants combined with the channels, or an operation
the analysis does not know. When such an unknown operation is all that keeps a
removable group, :class:`ChannelGraphError` names the module that runs it.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ChannelGraph", "ChannelGraphError", "trace_channels", "shrink_layers"]


class ChannelGraphError(RuntimeError):
    """The channel analysis cannot follow a module of the model (it cannot be
    traced, or an operation it does not know touches channels that would be
    removed); the message names the module."""


# ---------------------------------------------------------------------------- the layers kept whole
def _fb_type():
    from prunopt.nn.interspace import FBConv2d

    return FBConv2d


_BatchNorm = nn.modules.batchnorm._BatchNorm


def _is_atomic(m: nn.Module) -> bool:
    return isinstance(m, (nn.Conv2d, nn.Linear, _BatchNorm, _fb_type()))


# ---------------------------------------------------------------------------- the op vocabulary
# zero-preserving elementwise ops (f(0) = 0, channel c of the output depends on channel c only)
_ZERO_PRESERVING = {
    "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "mish", "tanh", "hardswish",
    "hardshrink", "softshrink", "tanhshrink", "softsign", "sin", "abs", "neg", "square", "dropout",
    "feature_dropout", "dropout2d", "dropout1d", "alpha_dropout", "feature_alpha_dropout", "identity", "clone",
    "contiguous", "detach", "alias", "to", "type", "float", "double", "half", "bfloat16", "type_as",
    "_to_copy", "lift_fresh_copy",
}
# elementwise, channel by channel, but f(0) != 0
_CHANNELWISE = {"sigmoid", "hardsigmoid", "exp", "cos", "softplus", "log_sigmoid", "logsigmoid", "erf"}
_POOLS = {"max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "max_pool2d_with_indices",
          "upsample_nearest2d", "upsample_bilinear2d", "interpolate", "lp_pool2d", "max_pool1d", "avg_pool1d",
          "adaptive_avg_pool1d", "adaptive_max_pool1d"}
_REDUCTIONS = {"mean", "sum", "amax", "amin"}
_BINARY = {"add", "sub", "mul", "div", "rsub", "true_divide"}
_SHAPE_QUERIES = {"size", "sym_size", "dim", "numel", "sym_numel", "sym_stride", "stride", "_assert_tensor_metadata",
                  "_assert_scalar", "sym_constrain_range_for_size", "getattr", "_assert_async"}
_VIEWS = {"view", "reshape", "_unsafe_view"}

_MODULE_OPS = {
    nn.ReLU: "relu", nn.ReLU6: "relu6", nn.LeakyReLU: "leaky_relu", nn.ELU: "elu", nn.SELU: "selu", nn.CELU: "celu",
    nn.GELU: "gelu", nn.SiLU: "silu", nn.Mish: "mish", nn.Tanh: "tanh", nn.Hardswish: "hardswish",
    nn.Hardtanh: "hardtanh", nn.Softsign: "softsign", nn.Dropout: "dropout", nn.Dropout2d: "dropout",
    nn.Dropout1d: "dropout", nn.AlphaDropout: "dropout", nn.Identity: "identity", nn.Sigmoid: "sigmoid",
    nn.Hardsigmoid: "hardsigmoid", nn.Softplus: "softplus", nn.MaxPool2d: "max_pool2d", nn.AvgPool2d: "avg_pool2d",
    nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d", nn.AdaptiveMaxPool2d: "adaptive_max_pool2d", nn.Flatten: "flatten",
    nn.Upsample: "interpolate",
}


def _function_op(target) -> Optional[str]:
    """The op name of an fx ``call_function`` target (torch function, operator, aten overload)."""
    if isinstance(target, torch._ops.OpOverload):
        return target._overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    known = {operator.add: "add", operator.iadd: "add_", operator.sub: "sub", operator.isub: "sub_",
             operator.mul: "mul", operator.imul: "mul_", operator.truediv: "div", operator.itruediv: "div_",
             operator.getitem: "getitem", getattr: "getattr", F.relu6: "relu6", F.hardtanh: "hardtanh",
             F.pad: "pad", torch.flatten: "flatten", torch.cat: "cat", torch.concat: "cat", torch.concatenate: "cat"}
    if target in known:
        return known[target]
    return getattr(target, "__name__", None)


def _strip_inplace(name: str) -> Tuple[str, bool]:
    if name.endswith("_") and not name.startswith("_"):
        return name[:-1], True
    return name, False


# ---------------------------------------------------------------------------- values
@dataclass
class _Val:
    """A traced tensor. ``slots``: one slot id per channel (``None``: no channel
    structure known, e.g. token ids or a value a layer has not read yet); ``cdim``
    the channel dimension; ``zero`` the provably-zero channels; ``const`` a tensor
    computed from parameters and constants only (no activation)."""

    slots: Optional[List[int]] = None
    cdim: int = 1
    ndim: Optional[int] = None
    shape: Optional[Tuple[int, ...]] = None
    zero: Optional[List[bool]] = None
    const: bool = False
    spatial1: bool = False  # every dimension after the channels is known to be 1
    lazy_input: bool = False  # a graph input without a known shape: slots made (pinned) at first read
    tensor: bool = True


@dataclass
class _Call:
    """One call of a layer kept whole (conv, linear, BN, FBConv2d)."""

    name: str
    module: nn.Module
    input: _Val
    output: _Val


class _Slots:
    """Union-find over the channel slots, with per-slot facts."""

    def __init__(self):
        self.parent: List[int] = []
        self.read_nonzero: List[bool] = []  # read by a contraction where it may be non-zero
        self.zero_somewhere: List[bool] = []
        self.pin: List[Optional[str]] = []  # a known reason that keeps the channel
        self.unknown: List[Optional[str]] = []  # an op the analysis cannot follow

    def new(self, n: int) -> List[int]:
        start = len(self.parent)
        for i in range(n):
            self.parent.append(start + i)
            self.read_nonzero.append(False)
            self.zero_somewhere.append(False)
            self.pin.append(None)
            self.unknown.append(None)
        return list(range(start, start + n))

    def find(self, a: int) -> int:
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:
            self.parent[a], a = root, self.parent[a]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


# ---------------------------------------------------------------------------- tracing
def _trace(model: nn.Module, example_input):
    """``(graph, kind, extra)``: an fx graph of ``model`` with the known layers
    as leaves (shapes propagated on ``example_input`` when given), or, when fx
    cannot trace the model symbolically (e.g. Python control flow on input
    shapes, as in transformers' models) and ``example_input`` is given, the
    ``torch.export`` (ATen) graph with the parameter and buffer names of its
    placeholders."""
    tracer = _LeafTracer()
    try:
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 - any failure is reported with its cause
        if example_input is None:
            where = f" in module {tracer.current!r}" if tracer.current else ""
            raise ChannelGraphError(
                f"torch.fx.symbolic_trace could not trace {type(model).__name__}{where} ({type(e).__name__}: "
                f"{_first_line(e)}); pass example_input so that the model is traced with torch.export instead"
            ) from e
        return _export(model, example_input)
    if example_input is not None:
        from torch.fx.passes.shape_prop import ShapeProp

        args = example_input if isinstance(example_input, tuple) else (example_input,)
        try:
            ShapeProp(torch.fx.GraphModule(model, graph)).propagate(*args)
        except Exception as e:  # noqa: BLE001
            raise ChannelGraphError(f"{type(model).__name__} does not run on example_input ({type(e).__name__}: "
                                    f"{_first_line(e)})") from e
    return graph, "fx", None


def _export(model: nn.Module, example_input):
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    try:
        ep = torch.export.export(model, args, strict=False)
    except Exception as e:  # noqa: BLE001
        raise ChannelGraphError(
            f"neither torch.fx nor torch.export could trace {type(model).__name__} on example_input "
            f"(torch.export: {type(e).__name__}: {_first_line(e)})") from e
    sig = ep.graph_signature
    consts = dict(sig.inputs_to_parameters)
    consts.update(sig.inputs_to_buffers)
    consts.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    return ep.graph, "export", consts


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


class _LeafTracer(torch.fx.Tracer):
    """fx tracer that keeps the known layers and prunopt's modules whole and
    records which module it is in (for error messages)."""

    def __init__(self):
        super().__init__()
        self.current = ""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return _is_atomic(m) or type(m).__module__.startswith("prunopt.nn.") or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        outer = self.current
        self.current = self.path_of_module(m)
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self.current = outer


def _meta_shape(node) -> Optional[Tuple[int, ...]]:
    meta = node.meta if hasattr(node, "meta") else {}
    tm = meta.get("tensor_meta")  # fx ShapeProp
    if tm is not None and hasattr(tm, "shape"):
        return tuple(int(s) for s in tm.shape)
    val = meta.get("val")  # torch.export
    if isinstance(val, Tensor):
        try:
            return tuple(int(s) for s in val.shape)
        except TypeError:  # symbolic sizes
            return None
    return None


def _meta_is_tensor(node) -> Optional[bool]:
    meta = node.meta if hasattr(node, "meta") else {}
    if "tensor_meta" in meta:
        tm = meta["tensor_meta"]
        return None if isinstance(tm, (tuple, list, dict)) else hasattr(tm, "shape")
    val = meta.get("val")
    if val is None:
        return None
    return isinstance(val, Tensor)


# ---------------------------------------------------------------------------- the analysis
class ChannelGraph:
    """The channel groups of ``model`` traced on ``example_input`` (or
    symbolically without one). After construction:

    * :attr:`calls`: every call of a layer kept whole (conv, linear, BN,
      FBConv2d), with its input and output values (``_Call``);
    * :meth:`keep`: the channels of a traced value that stay;
    * :meth:`removes_anything`: whether any channel goes.

    :func:`shrink_layers` then slices the layers.

    ``ChannelGraphError`` when the model cannot be traced, or when a removable
    group is held only by an operation the analysis cannot follow (naming the
    module that runs it)."""

    def __init__(self, model: nn.Module, example_input=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        self.slots = _Slots()
        self.calls: List[_Call] = []
        self.values: List[_Val] = []
        graph, kind, consts = _trace(model, example_input)
        self.kind = kind
        self._modules = dict(model.named_modules())
        if kind == "export":
            self._walk_export(graph, consts)
        else:
            self._walk_fx(graph)
        self._decide()

    # -------------------------------------------------------------- slot helpers
    def _new(self, n: int, cdim: int = 1, ndim: Optional[int] = None, shape=None, zero=None) -> _Val:
        v = _Val(self.slots.new(n), cdim, ndim, shape, list(zero) if zero is not None else [False] * n)
        for s, z in zip(v.slots, v.zero):
            if z:
                self.slots.zero_somewhere[s] = True
        self.values.append(v)
        return v

    def _set_zero(self, v: _Val, zero: Sequence[bool]) -> None:
        v.zero = [bool(z) for z in zero]
        for s, z in zip(v.slots, v.zero):
            if z:
                self.slots.zero_somewhere[s] = True

    def _pin(self, v: Optional[_Val], reason: str, unknown: bool = False) -> None:
        if v is None or v.slots is None:
            return
        for s in v.slots:
            if unknown:
                if self.slots.unknown[s] is None:
                    self.slots.unknown[s] = reason
            elif self.slots.pin[s] is None:
                self.slots.pin[s] = reason

    def _ensure(self, v: _Val, n: int, where: str) -> bool:
        """Slots for a value read with ``n`` channels: a graph input gets pinned
        slots at its first read. False when the value has no channel structure
        (an opaque tensor)."""
        if v.slots is None:
            if not v.lazy_input:
                return False
            fresh = self._new(n, v.cdim, v.ndim, v.shape)
            v.slots, v.zero = fresh.slots, fresh.zero
            self._pin(v, "an input of the model")
            return True
        if len(v.slots) != n:
            raise ChannelGraphError(f"module {where!r}: expects {n} channels, the traced input has {len(v.slots)}")
        return True

    def _read(self, v: _Val) -> None:
        """A contraction (conv, linear) reads every channel of ``v``."""
        for s, z in zip(v.slots, v.zero):
            if not z:
                self.slots.read_nonzero[s] = True

    def _like(self, v: _Val, zero=None, *, shape=None, spatial1=None) -> _Val:
        """A value with the channels of ``v`` joined to it (elementwise ops)."""
        out = _Val(list(v.slots), v.cdim, v.ndim, shape if shape is not None else v.shape,
                   list(v.zero if zero is None else zero), False, v.spatial1 if spatial1 is None else spatial1)
        self._set_zero(out, out.zero)
        self.values.append(out)
        return out

    def _opaque(self, shape=None, const: bool = False) -> _Val:
        return _Val(None, 1, len(shape) if shape is not None else None, shape, None, const)

    # -------------------------------------------------------------- the walks
    def _walk_export(self, graph, consts: Dict[str, str]) -> None:
        env: Dict[object, object] = {}
        groups = self._atomic_groups(graph, consts)
        member_of = {n: key for key, g in groups.items() for n in g["nodes"]}
        for node in graph.nodes:
            if node.op == "placeholder":
                if node.name in consts:
                    env[node] = self._opaque(_meta_shape(node), const=True)
                else:
                    env[node] = self._input_value(_meta_shape(node), _meta_is_tensor(node))
                continue
            if node.op == "output":
                self._output(self._map(node.args, env))
                continue
            if node.op == "get_attr":
                env[node] = self._opaque(_meta_shape(node), const=True)
                continue
            key = member_of.get(node)
            if key is not None:
                g = groups[key]
                if node is not g["output"]:
                    env[node] = None  # an inner value of the layer: never read from outside
                    continue
                x = env[g["input"]]
                env[node] = self._module_call(g["name"], g["module"], x, _meta_shape(node))
                continue
            name, inplace = _strip_inplace(_function_op(node.target) or str(node.target))
            where = self._where(node)
            args, kwargs = self._map(node.args, env), self._map(node.kwargs, env)
            out = self._function(name, args, kwargs, where, _meta_shape(node), node)
            if inplace and args and isinstance(args[0], _Val) and isinstance(out, _Val):
                env[node.args[0]] = out  # the mutated input is the output from here on
            env[node] = out

    def _walk_fx(self, graph) -> None:
        env: Dict[object, object] = {}
        for node in graph.nodes:
            shape = _meta_shape(node)
            if node.op == "placeholder":
                env[node] = self._input_value(shape, _meta_is_tensor(node) if "tensor_meta" in node.meta else True)
            elif node.op == "output":
                self._output(self._map(node.args, env))
            elif node.op == "get_attr":
                env[node] = self._opaque(shape, const=True)
            elif node.op == "call_module":
                m = self._modules[node.target]
                args, kwargs = self._map(node.args, env), self._map(node.kwargs, env)
                x = args[0] if args else None
                if _is_atomic(m):
                    env[node] = self._module_call(node.target, m, x, shape)
                else:
                    env[node] = self._leaf_module(node.target, m, args, kwargs, shape)
            else:
                target = node.target if node.op == "call_method" else _function_op(node.target)
                name, inplace = _strip_inplace(str(target))
                args, kwargs = self._map(node.args, env), self._map(node.kwargs, env)
                out = self._function(name, args, kwargs, self._fx_where(node), shape, node)
                if inplace and args and isinstance(args[0], _Val) and isinstance(out, _Val):
                    env[node.args[0]] = out
                env[node] = out

    @staticmethod
    def _map(a, env):
        return torch.fx.node.map_arg(a, lambda n: env.get(n))

    def _input_value(self, shape, is_tensor) -> _Val:
        if is_tensor is False:
            return _Val(None, tensor=False)
        if shape is None:
            return _Val(None, lazy_input=True)
        if len(shape) < 2:
            return self._opaque(shape)
        v = self._new(shape[1], 1, len(shape), shape)
        self._pin(v, "an input of the model")
        return v

    def _output(self, outs) -> None:
        for v in torch.utils._pytree.tree_leaves(outs):
            if isinstance(v, _Val):
                self._pin(v, "an output of the model")

    @staticmethod
    def _fx_where(node) -> str:
        stack = node.meta.get("nn_module_stack") if hasattr(node, "meta") else None
        return list(stack.values())[-1][0] if stack else ""

    def _where(self, node) -> str:
        stack = node.meta.get("nn_module_stack") if hasattr(node, "meta") else None
        if not stack:
            return ""
        return list(stack.values())[-1][0]

    def _atomic_groups(self, graph, consts: Dict[str, str]) -> Dict[str, dict]:
        """The exported nodes of each call of a layer kept whole: keyed by the
        call's ``nn_module_stack`` key (``"...@1"`` for a second call), with its
        single activation input and its output node."""
        groups: Dict[str, dict] = {}
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            stack = node.meta.get("nn_module_stack") or {}
            for key, (fqn, _) in stack.items():
                m = self._modules.get(fqn)
                if m is not None and _is_atomic(m):
                    g = groups.setdefault(key, {"name": fqn, "module": m, "nodes": []})
                    g["nodes"].append(node)
                    break
        params = {n for n in graph.nodes if n.op == "get_attr" or (n.op == "placeholder" and n.name in consts)}
        for key, g in groups.items():
            members = set(g["nodes"])
            inputs = []
            for n in g["nodes"]:
                for a in n.all_input_nodes:
                    if a not in members and a not in inputs:
                        inputs.append(a)
            acts = [a for a in inputs if a not in params]
            outs = [n for n in g["nodes"] if any(u not in members for u in n.users)]
            if len(acts) != 1 or len(outs) != 1:
                raise ChannelGraphError(
                    f"module {g['name']!r} ({type(g['module']).__name__}): its traced call reads {len(acts)} "
                    f"activations and returns {len(outs)} values; expected one of each")
            g["input"], g["output"] = acts[0], outs[0]
        return groups

    # -------------------------------------------------------------- layers kept whole
    def _module_call(self, name: str, m: nn.Module, x, out_shape) -> _Val:
        if not isinstance(x, _Val) or not x.tensor:
            raise ChannelGraphError(f"module {name!r} ({type(m).__name__}): its input is not a traced tensor")
        fb = _fb_type()
        if isinstance(m, _BatchNorm):
            return self._batchnorm(name, m, x, out_shape)
        if isinstance(m, (nn.Conv2d, fb)):
            return self._conv(name, m, x, out_shape)
        return self._linear(name, m, x, out_shape)

    def _record(self, name, m, x, out) -> _Val:
        """Remembers the call; a layer called several times keeps one set of
        channels, so its calls' channels are joined."""
        for c in self.calls:
            if c.module is m:
                for a, b in ((c.input, x), (c.output, out)):
                    if a.slots is not None and b.slots is not None and len(a.slots) == len(b.slots):
                        for s, t in zip(a.slots, b.slots):
                            self.slots.union(s, t)
                    else:
                        self._pin(a, f"module {name!r}, called on inputs of different shapes")
                        self._pin(b, f"module {name!r}, called on inputs of different shapes")
                break
        self.calls.append(_Call(name, m, x, out))
        return out

    def _conv(self, name: str, m, x: _Val, out_shape) -> _Val:
        fb = isinstance(m, _fb_type())
        c_in, c_out, groups = m.in_channels, m.out_channels, m.groups
        if x.ndim is not None and x.ndim != 4:
            self._pin(x, f"module {name!r} reads an input of {x.ndim} dimensions", unknown=True)
            out = self._new(c_out, 1, x.ndim, out_shape)
            self._pin(out, f"module {name!r} reads an input of {x.ndim} dimensions", unknown=True)
            return self._record(name, m, x, out)
        has = self._ensure(x, c_in, name)
        with torch.no_grad():
            w = (m.coefficients * m.mask) if fb else m.weight
            rows_zero = (w.reshape(c_out, -1) == 0).all(dim=1)
            bias_zero = torch.ones(c_out, dtype=torch.bool, device=w.device) if m.bias is None else m.bias == 0
        depthwise = groups > 1 and groups == c_in == c_out
        if depthwise and has:
            in_zero = torch.tensor(x.zero, dtype=torch.bool, device=w.device)
            zero = ((rows_zero | in_zero) & bias_zero).tolist()
            out = self._like(x, zero, shape=out_shape, spatial1=False)
            out.ndim = 4
            return self._record(name, m, x, out)
        out = self._new(c_out, 1, 4, out_shape, (rows_zero & bias_zero).tolist())
        if has:
            if groups == 1:
                self._read(x)
            else:
                self._pin(x, f"the grouped convolution {name!r} (groups={groups})")
                self._pin(out, f"the grouped convolution {name!r} (groups={groups})")
        return self._record(name, m, x, out)

    def _linear(self, name: str, m: nn.Linear, x: _Val, out_shape) -> _Val:
        ndim = x.ndim
        last = ndim - 1 if ndim is not None else None
        if x.slots is None and x.lazy_input:
            x.cdim = -1 if ndim is None else ndim - 1
        reads_cdim = (x.cdim == -1 or (last is not None and x.cdim == last) or (ndim is None and x.spatial1)
                      or x.ndim == 2)
        with torch.no_grad():
            rows_zero = (m.weight == 0).all(dim=1)
            if m.bias is not None:
                rows_zero &= m.bias == 0
        out = self._new(m.out_features, (ndim - 1) if ndim is not None else -1, ndim, out_shape, rows_zero.tolist())
        if x.slots is not None and not reads_cdim:
            # the layer contracts another dimension than the traced channels (e.g. the features of a
            # (B, L, C) sequence after an operation the analysis does not know, whose dim 1 was taken for
            # the channels): those channels stay, and the layer's inputs are not followed
            self._pin(x, f"module {name!r} (Linear) reads a dimension that is not the channels", unknown=True)
            return self._record(name, m, self._opaque(x.shape), out)
        has = self._ensure(x, m.in_features, name) if (x.slots is not None or x.lazy_input) else False
        if has:
            if reads_cdim:
                self._read(x)
            else:
                self._pin(x, f"module {name!r} (Linear) reads a dimension that is not the channels", unknown=True)
        return self._record(name, m, x, out)

    def _batchnorm(self, name: str, m, x: _Val, out_shape) -> _Val:
        from prunopt.nn.sparsification import SparseBatchNorm2d

        n = m.num_features
        if not self._ensure(x, n, name):
            out = self._new(n, 1, x.ndim, out_shape)
            self._pin(out, f"module {name!r} reads a tensor whose channels are not traced", unknown=True)
            return self._record(name, m, x, out)
        with torch.no_grad():
            in_zero = torch.tensor(x.zero, dtype=torch.bool)
            if isinstance(m, SparseBatchNorm2d):
                a = m.gate().detach().cpu()
                # y = a (x_hat + b): 0 where the gate is 0 (eq. 17), or where x = 0, mu = 0 and b = 0
                shift_zero = m.shift.detach().cpu() == 0
                mean_zero = m.running_mean.detach().cpu() == 0 if m.running_mean is not None else \
                    torch.zeros(n, dtype=torch.bool)
                zero = (a == 0) | (in_zero & mean_zero & shift_zero)
            else:
                mean_zero = m.running_mean.detach().cpu() == 0 if m.running_mean is not None else \
                    torch.zeros(n, dtype=torch.bool)
                if m.affine:
                    w0 = m.weight.detach().cpu() == 0
                    b0 = m.bias.detach().cpu() == 0
                    zero = b0 & (w0 | (in_zero & mean_zero))
                else:
                    zero = in_zero & mean_zero
        out = self._like(x, zero.tolist(), shape=out_shape)
        return self._record(name, m, x, out)

    def _leaf_module(self, name: str, m: nn.Module, args, kwargs, out_shape=None):
        """An fx leaf that is not kept whole: mapped to the op it runs."""
        op = _MODULE_OPS.get(type(m))
        if op is None:
            return self._unknown(f"module {name!r} ({type(m).__name__})", args, kwargs, out_shape)
        if op == "flatten":
            kwargs = dict(kwargs, start_dim=m.start_dim, end_dim=m.end_dim)
        elif op in ("adaptive_avg_pool2d", "adaptive_max_pool2d"):
            kwargs = dict(kwargs, output_size=m.output_size)
        elif op == "hardtanh":
            kwargs = dict(kwargs, min_val=m.min_val, max_val=m.max_val)
        return self._function(op, list(args[:1]), kwargs, name, out_shape, None)

    # -------------------------------------------------------------- functions
    def _function(self, name: str, args, kwargs, where: str, out_shape, node):
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, _Val) and a.tensor]
        if name in _SHAPE_QUERIES:
            return _Val(None, tensor=False)
        if node is not None and _meta_is_tensor(node) is False and name != "getitem" and \
                not isinstance(node.meta.get("val"), (tuple, list)):
            return _Val(None, tensor=False)  # a symbolic int or bool
        if tensors and all(t.const for t in tensors):
            return self._opaque(out_shape, const=True)  # parameters only: a constant
        if not tensors:
            return self._opaque(out_shape, const=True) if out_shape is not None else _Val(None, const=True)
        label = f"{name} in module {where!r}" if where else name
        if name == "getitem":
            return self._getitem(args, label, out_shape)
        x = args[0] if args else None
        if name in _ZERO_PRESERVING or name in _CHANNELWISE or name in ("hardtanh", "clamp", "relu6"):
            if not isinstance(x, _Val) or x.slots is None:
                return self._passthrough(x, out_shape)
            keeps = name in _ZERO_PRESERVING or self._clamp_keeps_zero(name, args, kwargs)
            return self._like(x, x.zero if keeps else [False] * len(x.slots), shape=out_shape)
        if name in _BINARY:
            return self._binary(name, args, kwargs, label, out_shape)
        if name in _POOLS:
            return self._pool(name, x, args, kwargs, label, out_shape)
        if name in _REDUCTIONS:
            return self._reduce(x, args, kwargs, label, out_shape)
        if name == "flatten":
            return self._flatten(x, args, kwargs, label, out_shape)
        if name in _VIEWS:
            return self._view(x, args, label, out_shape)
        if name in ("cat", "concat", "concatenate"):
            return self._cat(args, kwargs, label, out_shape)
        if name in ("pad", "constant_pad_nd"):
            return self._pad(name, x, args, kwargs, label, out_shape)
        return self._unknown(label, args, kwargs, out_shape)

    def _passthrough(self, x, out_shape):
        if isinstance(x, _Val):
            out = _Val(None, x.cdim, x.ndim, out_shape or x.shape, None, x.const, x.spatial1, x.lazy_input)
            return out
        return self._opaque(out_shape)

    @staticmethod
    def _clamp_keeps_zero(name, args, kwargs) -> bool:
        if name == "relu6":
            return True
        if name == "hardtanh":
            lo = args[1] if len(args) > 1 else kwargs.get("min_val", -1.0)
            hi = args[2] if len(args) > 2 else kwargs.get("max_val", 1.0)
        else:  # clamp(x, min=None, max=None)
            lo = args[1] if len(args) > 1 else kwargs.get("min")
            hi = args[2] if len(args) > 2 else kwargs.get("max")
        ok = lambda v, le: v is None or (isinstance(v, numbers.Real) and (v <= 0 if le else v >= 0))  # noqa: E731
        return ok(lo, True) and ok(hi, False)

    def _unknown(self, label: str, args, kwargs, out_shape):
        for v in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(v, _Val):
                self._pin(v, label, unknown=True)
        if out_shape is not None and len(out_shape) >= 2:
            out = self._new(out_shape[1], 1, len(out_shape), out_shape)
            self._pin(out, label, unknown=True)
            return out
        return self._opaque(out_shape)

    def _getitem(self, args, label, out_shape):
        base, idx = args[0], args[1]
        if isinstance(base, (tuple, list)):
            return base[idx] if isinstance(idx, int) and -len(base) <= idx < len(base) else self._opaque(out_shape)
        if isinstance(base, _Val) and base.slots is None:
            return self._passthrough(base, out_shape)
        return self._unknown(label, args, {}, out_shape)  # slicing a tensor

    def _binary(self, name, args, kwargs, label, out_shape):
        a = args[0] if args else kwargs.get("input")
        b = args[1] if len(args) > 1 else kwargs.get("other")
        alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
        if name == "rsub":
            a, b, name = b, a, "sub"
        vals = [v for v in (a, b) if isinstance(v, _Val) and v.slots is not None]
        if not vals:
            src = a if isinstance(a, _Val) else b
            return self._passthrough(src, out_shape)
        if len(vals) == 2:
            if len(a.slots) != len(b.slots) or a.cdim != b.cdim:
                self._pin(a, label, unknown=True)
                self._pin(b, label, unknown=True)
                return self._like(a, [False] * len(a.slots), shape=out_shape)
            for s, t in zip(a.slots, b.slots):
                self.slots.union(s, t)
            za, zb = a.zero, b.zero
            if name in ("add", "sub"):
                zero = [x and y for x, y in zip(za, zb)]
            elif name == "mul":
                zero = [x or y for x, y in zip(za, zb)]
            else:
                zero = list(za)
            return self._like(a, zero, shape=out_shape, spatial1=a.spatial1 and b.spatial1)
        v = vals[0]
        other = b if v is a else a
        v_first = v is a
        if isinstance(other, _Val) and other.tensor and not self._scalar_like(other, v):
            if other.slots is None and other.lazy_input is False and other.const:
                self._pin(v, f"{label}: a constant tensor (a parameter or buffer outside a layer the analysis "
                             "knows) combined with the channels", unknown=True)
            else:
                self._pin(v, label, unknown=True)
            return self._like(v, [False] * len(v.slots), shape=out_shape)
        scalar = other if isinstance(other, numbers.Number) else None
        if name in ("add", "sub"):
            keeps = scalar is not None and (scalar == 0 or alpha == 0)
            zero = v.zero if keeps else [False] * len(v.slots)
        elif name == "mul":
            zero = v.zero if not (scalar is not None and scalar == 0) else [True] * len(v.slots)
        else:  # div: zero / x = 0 for the numerator only
            zero = v.zero if v_first else [False] * len(v.slots)
        return self._like(v, zero, shape=out_shape)

    @staticmethod
    def _scalar_like(other: _Val, v: _Val) -> bool:
        """A tensor operand that broadcasts one value over every channel."""
        if other.shape is None:
            return False
        if math.prod(other.shape) == 1:
            return True
        nd = v.ndim if v.ndim is not None else len(other.shape)
        cd = v.cdim if v.cdim >= 0 else nd + v.cdim
        k = cd - (nd - len(other.shape))  # the channel axis of other, aligned from the right
        return k < 0 or other.shape[k] == 1

    def _pool(self, name, x, args, kwargs, label, out_shape):
        if not isinstance(x, _Val) or x.slots is None:
            return self._passthrough(x, out_shape)
        spatial1 = False
        if name in ("adaptive_avg_pool2d", "adaptive_max_pool2d", "adaptive_avg_pool1d", "adaptive_max_pool1d"):
            size = args[1] if len(args) > 1 else kwargs.get("output_size")
            sizes = (size,) if isinstance(size, int) else tuple(size) if size is not None else ()
            spatial1 = bool(sizes) and all(s == 1 for s in sizes)
        if out_shape is not None:
            spatial1 = all(s == 1 for s in out_shape[2:])
        out = self._like(x, x.zero, shape=out_shape, spatial1=spatial1)
        if name.endswith("with_indices") or (name == "adaptive_max_pool2d" and self.kind == "export"):
            return (out, self._opaque(out_shape))
        return out

    def _reduce(self, x, args, kwargs, label, out_shape):
        if not isinstance(x, _Val) or x.slots is None:
            return self._passthrough(x, out_shape)
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        if isinstance(dims, int):
            dims = [dims]
        nd = x.ndim
        if dims is None or nd is None:
            return self._unknown(label, args, kwargs, out_shape)
        dims = sorted(d % nd for d in dims)
        cd = x.cdim % nd
        if cd in dims or 0 in dims:
            return self._unknown(label, args, kwargs, out_shape)  # over the channels or the batch
        if any(d < cd for d in dims):
            return self._unknown(label, args, kwargs, out_shape)
        out = self._like(x, x.zero, shape=out_shape)
        rest = [d for d in range(cd + 1, nd) if d not in dims]
        out.ndim = nd if keepdim else nd - len(dims)
        out.spatial1 = not rest or (keepdim and x.spatial1)
        if not keepdim and out.ndim == cd + 1:
            out.spatial1 = True
        return out

    def _flatten(self, x, args, kwargs, label, out_shape):
        if not isinstance(x, _Val) or x.slots is None:
            return self._passthrough(x, out_shape)
        start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
        end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
        nd = x.ndim
        cd = x.cdim
        if nd is None:
            if start == 1 and end == -1 and cd == 1:
                if x.spatial1:
                    out = self._like(x, x.zero, shape=out_shape, spatial1=True)
                    out.ndim = 2
                    return out
            return self._unknown(label, args, kwargs, out_shape)
        start, end, cd = start % nd, end % nd, cd % nd
        if start > cd or end < cd:
            out = self._like(x, x.zero, shape=out_shape)  # the channel dimension is not merged
            out.ndim = nd - (end - start)
            if start < cd:
                out.cdim = cd - (end - start)
            return out
        if start != cd:
            return self._unknown(label, args, kwargs, out_shape)  # channels merged with an earlier dim
        inner = 1
        if x.shape is not None:
            inner = math.prod(x.shape[cd + 1:end + 1])
        elif not x.spatial1:
            return self._unknown(label, args, kwargs, out_shape)
        return self._expand(x, inner, nd - (end - start), out_shape)

    def _expand(self, x: _Val, inner: int, ndim: int, out_shape) -> _Val:
        """Channel ``c`` becomes the features ``c * inner .. c * inner + inner - 1``."""
        if inner == 1:
            out = self._like(x, x.zero, shape=out_shape, spatial1=True)
        else:
            out = self._new(len(x.slots) * inner, x.cdim, ndim, out_shape,
                            [z for z in x.zero for _ in range(inner)])
            for c, s in enumerate(x.slots):
                for j in range(inner):
                    self.slots.union(s, out.slots[c * inner + j])
            out.spatial1 = True
        out.ndim = ndim
        return out

    def _view(self, x, args, label, out_shape):
        if not isinstance(x, _Val) or x.slots is None:
            return self._passthrough(x, out_shape)
        if x.shape is not None and out_shape is not None:
            cd = x.cdim % len(x.shape)
            if tuple(out_shape) == tuple(x.shape):
                return self._like(x, x.zero, shape=out_shape)
            if cd == 1 and len(out_shape) == 2 and out_shape[0] == x.shape[0]:
                return self._expand(x, math.prod(x.shape[2:]), 2, out_shape)
            if cd == 1 and len(out_shape) == 3 and tuple(out_shape[:2]) == tuple(x.shape[:2]):
                out = self._like(x, x.zero, shape=out_shape)
                out.ndim = 3
                return out
            return self._unknown(label, args, {}, out_shape)
        shape = args[1:] if len(args) > 1 else ()
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if x.spatial1 and x.cdim == 1 and len(shape) == 2 and shape[1] == -1:
            out = self._like(x, x.zero, shape=out_shape, spatial1=True)
            out.ndim = 2
            return out
        return self._unknown(label, args, {}, out_shape)

    def _cat(self, args, kwargs, label, out_shape):
        seq = args[0] if args else kwargs.get("tensors")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        vals = list(seq) if isinstance(seq, (tuple, list)) else []
        if not vals or not all(isinstance(v, _Val) and v.slots is not None for v in vals):
            return self._unknown(label, args, kwargs, out_shape)
        nd = vals[0].ndim
        cd = vals[0].cdim
        if nd is None and dim < 0 or any(v.cdim != cd for v in vals):
            return self._unknown(label, args, kwargs, out_shape)
        if nd is not None:
            dim, cd = dim % nd, cd % nd
        if dim == cd:
            slots = [s for v in vals for s in v.slots]
            zero = [z for v in vals for z in v.zero]
            out = _Val(slots, vals[0].cdim, nd, out_shape, zero, False,
                       all(v.spatial1 for v in vals))
            self.values.append(out)
            return out
        if any(len(v.slots) != len(vals[0].slots) for v in vals):
            return self._unknown(label, args, kwargs, out_shape)
        for v in vals[1:]:
            for s, t in zip(vals[0].slots, v.slots):
                self.slots.union(s, t)
        zero = [all(v.zero[c] for v in vals) for c in range(len(vals[0].slots))]
        return self._like(vals[0], zero, shape=out_shape, spatial1=False)

    def _pad(self, name, x, args, kwargs, label, out_shape):
        if not isinstance(x, _Val) or x.slots is None:
            return self._passthrough(x, out_shape)
        pad = args[1] if len(args) > 1 else kwargs.get("pad")
        if name == "constant_pad_nd":
            mode, value = "constant", args[2] if len(args) > 2 else kwargs.get("value", 0)
        else:
            mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
            value = args[3] if len(args) > 3 else kwargs.get("value", None)
        nd = x.ndim
        cd = x.cdim % nd if nd is not None else x.cdim
        touched = len(pad) // 2 if pad is not None else 99
        if nd is None or nd - touched <= cd:
            return self._unknown(label, args, kwargs, out_shape)  # pads the channels
        keeps = mode != "constant" or value in (None, 0, 0.0)
        return self._like(x, x.zero if keeps else [False] * len(x.slots), shape=out_shape, spatial1=False)

    # -------------------------------------------------------------- the decision
    def _decide(self) -> None:
        s = self.slots
        n = len(s.parent)
        roots = [s.find(i) for i in range(n)]
        read_nonzero, zero, pinned, unknown = {}, {}, {}, {}
        for i, r in enumerate(roots):
            read_nonzero[r] = read_nonzero.get(r, False) or s.read_nonzero[i]
            zero[r] = zero.get(r, False) or s.zero_somewhere[i]
            if s.pin[i] is not None and r not in pinned:
                pinned[r] = s.pin[i]
            if s.unknown[i] is not None and r not in unknown:
                unknown[r] = s.unknown[i]
        self._roots = roots
        self._removable = {r for r in set(roots)
                           if zero[r] and not read_nonzero[r] and r not in pinned and r not in unknown}
        blocked = sorted({unknown[r] for r in set(roots)
                          if zero[r] and not read_nonzero[r] and r not in pinned and r in unknown})
        if blocked:
            raise ChannelGraphError(
                "cannot follow the channels through " + "; ".join(blocked) + ": channels that are zero there "
                "could otherwise be removed. Rewrite that part of the model with operations the analysis knows "
                "(nn.Conv2d, nn.Linear, nn.BatchNorm2d, elementwise activations, additions, products, "
                "concatenations, pooling, flatten)")
        # a feature map keeps at least one channel (torch has no 0-channel convolution): the first one
        changed = True
        while changed:
            changed = False
            for v in self.values:
                if v.slots and all(self._roots[t] in self._removable for t in v.slots):
                    self._removable.discard(self._roots[v.slots[0]])
                    changed = True

    def keep(self, v: _Val) -> Tensor:
        """Indices of the channels of a traced value that stay."""
        return torch.tensor([c for c, t in enumerate(v.slots) if self._roots[t] not in self._removable],
                            dtype=torch.long)

    def removes_anything(self) -> bool:
        """Whether any channel of the model can be removed."""
        return bool(self._removable)


def trace_channels(model: nn.Module, example_input=None) -> ChannelGraph:
    """The :class:`ChannelGraph` of ``model`` (traced with ``torch.export`` on
    ``example_input``, or with ``torch.fx`` without one)."""
    return ChannelGraph(model, example_input)


# ---------------------------------------------------------------------------- shrinking the layers
def _take(t: Optional[Tensor], index: Tensor, dim: int):
    if t is None:
        return None
    out = t.detach().index_select(dim, index.to(t.device)).clone()
    return nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else out


def _full(keep: Optional[Tensor], n: int) -> bool:
    return keep is None or keep.numel() == n


def shrink_layers(graph: ChannelGraph) -> Dict[str, Tuple[nn.Module, Tensor]]:
    """Removes, in place, the channels :class:`ChannelGraph` found removable
    from the layers of ``graph.model``: output channels (weight rows, bias) of
    convolutions, FBConv2d layers and linear layers, their input channels
    (weight columns; for a depthwise convolution both, with ``groups``), and the
    channels of plain BatchNorm layers. Returns ``{name: (module, kept
    channels)}`` for every BatchNorm layer traced (a
    :class:`~prunopt.nn.SparseBatchNorm2d` is left to the caller: its gate
    cannot be sliced without changing its threshold). A layer whose tensors are
    parametrized (e.g. a ``Masker``'s masks) is a ``ChannelGraphError`` naming
    it when it would lose channels."""
    from torch.nn.utils import parametrize

    from prunopt.nn.sparsification import SparseBatchNorm2d

    fb_type = _fb_type()
    done, bns = set(), {}
    for call in graph.calls:
        m = call.module
        if id(m) in done:
            continue
        done.add(id(m))
        out_keep = graph.keep(call.output) if call.output.slots is not None else None
        in_keep = graph.keep(call.input) if call.input.slots is not None else None
        if isinstance(m, _BatchNorm):
            keep = out_keep if out_keep is not None else torch.arange(m.num_features)
            bns[call.name] = (m, keep)
            if isinstance(m, SparseBatchNorm2d) or _full(keep, m.num_features):
                continue
            _refuse_parametrized(m, call.name, parametrize)
            if m.running_mean is not None:
                m.running_mean = _take(m.running_mean, keep, 0)
                m.running_var = _take(m.running_var, keep, 0)
            if m.affine:
                m.weight, m.bias = _take(m.weight, keep, 0), _take(m.bias, keep, 0)
            m.num_features = keep.numel()
            continue
        if isinstance(m, nn.Linear):
            n_in, n_out = m.in_features, m.out_features
        else:
            n_in, n_out = m.in_channels, m.out_channels
        if _full(in_keep, n_in) and _full(out_keep, n_out):
            continue
        _refuse_parametrized(m, call.name, parametrize)
        in_keep = torch.arange(n_in) if in_keep is None else in_keep
        out_keep = torch.arange(n_out) if out_keep is None else out_keep
        if isinstance(m, nn.Linear):
            m.weight = _take(_take(m.weight, out_keep, 0), in_keep, 1)
            m.bias = _take(m.bias, out_keep, 0)
            m.in_features, m.out_features = in_keep.numel(), out_keep.numel()
            continue
        depthwise = m.groups > 1 and m.groups == n_in == n_out
        if not (depthwise or m.groups == 1):
            raise ChannelGraphError(f"module {call.name!r}: a grouped convolution cannot lose channels")
        if depthwise and not torch.equal(in_keep, out_keep):
            raise ChannelGraphError(f"module {call.name!r}: the depthwise convolution would keep different input "
                                    "and output channels")
        if isinstance(m, fb_type):
            lam = _take(m.coefficients, out_keep, 0)
            mask = _take(m.mask, out_keep, 0)
            if not depthwise:
                lam, mask = _take(lam, in_keep, 1), _take(mask, in_keep, 1)
            m.coefficients, m.mask = lam, mask
            m._drop_inference_caches()
        else:
            w = _take(m.weight, out_keep, 0)
            m.weight = w if depthwise else _take(w, in_keep, 1)
        m.bias = _take(m.bias, out_keep, 0)
        m.in_channels, m.out_channels = in_keep.numel(), out_keep.numel()
        if depthwise:
            m.groups = out_keep.numel()
    return bns


def _refuse_parametrized(m: nn.Module, name: str, parametrize) -> None:
    if parametrize.is_parametrized(m):
        raise ChannelGraphError(
            f"module {name!r} would lose channels but its tensors are parametrized "
            f"({list(m.parametrizations.keys())}, e.g. a Masker's masks): remove the parametrizations first "
            "(masker.remove() or torch.nn.utils.parametrize.remove_parametrizations)")
