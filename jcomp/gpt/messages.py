"""The message plan: every message the 3-D train step sends, in one place.

    plan = messages.plan(pol, n_layers=4, mesh_shape={"data": 2, "tensor": 2,
                                                      "pipeline": 2})
    plan.block_exit.at(3)         # layer 3's row-parallel all-reduces
    plan.describe()               # "data.grad_reduce=int4:rot tensor.block_exit=... ..."

A policy (jcomp.gpt.policy) is the user's (axis, kind) table; the plan is what it
means for one model on one mesh: one `Message` per field of `Plan`, each with
its axis, direction, collective and codec per place. The step's leaf functions
receive only their own field. A message over an axis of size 1 does not exist,
so `describe` (the metrics' `compression` field) never lists it. EXACT lists
the few messages no entry reaches, which a codec would only make wrong.

Two hops. On a mesh with a 'dcn' axis (mesh.dcn_data > 1) the optimizer's
messages go hop by hop: grad_reduce and param_gather over the fast 'data'
factor (entries data.grad, data.param) and grad_reduce_dcn and
param_gather_dcn over the slow 'dcn' factor (entries dcn.grad, dcn.param,
which default to the data entries). The gradient reduce-scatter runs the fast
hop first, so the slow hop carries 1/|data| of the buffer; the gather runs the
slow hop first, on the small shard. Without a 'dcn' axis the dcn messages have
size 1 and do not exist. `Plan.data_axes` names the data-parallel axes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jcomp import codecs

EXACT = (
    ("tensor", "forward", "all-reduce", "cross-entropy max, sum-exp and target logit per token"),
    ("data", "forward", "all-reduce", "the mean loss (a scalar)"),
    ("data+tensor+pipeline", "update", "all-reduce", "squared gradient norms (scalars)"),
)


@dataclasses.dataclass(frozen=True)
class Message:
    """One message of the step. `codecs` holds one codec per place, `places`
    the places' indices: global layers (block_exit, block_entry_grad), sending
    stages (stage_send: s -> s+1 for s = 0..p-2; stage_send_grad: s -> s-1 for
    s = 1..p-1; last_stage_sum: p-1; first_stage_grad: 0), or none (a message
    sent once)."""

    name: str
    entry: str  # the policy entry it reads, "axis.kind"
    direction: str  # "forward", "backward" or "update"
    op: str  # "all-reduce", "reduce-scatter", "all-gather", "permute"
    codecs: tuple
    size: int = 1  # devices along `axis`; 1: the message moves nothing
    places: tuple = ()
    place: str = ""  # "layers", "stages" or ""
    # What a lossy codec may mix (jcomp.collectives' `rows`): "independent" codes
    # every token's vector on its own, so no token's values reach another's;
    # "flat" codes flat buckets of gradients or parameters across leaves.
    rows: str = "independent"

    def __post_init__(self):
        object.__setattr__(self, "codecs", tuple(self.codecs))
        object.__setattr__(self, "places", tuple(self.places))

    @property
    def axis(self) -> str:
        return self.entry.partition(".")[0]

    @property
    def exists(self) -> bool:
        return self.size > 1

    @property
    def codec(self):
        if len(self.codecs) != 1:
            raise ValueError(f"{self.name} is sent in {len(self.codecs)} places; use .at(i)")
        return self.codecs[0]

    def at(self, index: int):
        """The codec at global layer or sending stage `index`."""
        return self.codecs[self.places.index(index)]

    def compressed(self) -> bool:
        return any(_kind(c) != "identity" for c in self.codecs)

    def describe(self) -> str:
        """ "int4:rot", "int4:rot[layers 2-3]" (compressed at those places only)."""
        on = [i for i, c in enumerate(self.codecs) if _kind(c) != "identity"]
        text = "/".join(sorted({str(self.codecs[i]) for i in on})) or "none"
        if on and len(on) < len(self.codecs):
            text += f"[{self.place} {format_indices([self.places[i] for i in on])}]"
        return text


def format_indices(idx) -> str:
    """(0, 1, 2, 3, 6) -> "0-3,6"."""
    runs, idx = [], sorted(idx)
    for i in idx:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _kind(codec) -> str:
    return codecs.parse(codec).kind


def _rest(codec):
    """Outside the blocks an autoencoder's tensor messages send its `rest` codec."""
    codec = codecs.parse(codec)
    return codecs.parse(codec.rest) if codec.kind == "learned" else codec


@dataclasses.dataclass(frozen=True)
class Plan:
    grad_reduce: Message
    param_gather: Message
    grad_reduce_dcn: Message
    param_gather_dcn: Message
    ae_grad_sum: Message
    embed_sum: Message
    head_entry_grad: Message
    block_exit: Message
    block_entry_grad: Message
    stage_send: Message
    stage_send_grad: Message
    last_stage_sum: Message
    first_stage_grad: Message
    error_feedback: bool = False
    data_axes: tuple = ("data",)  # the data-parallel mesh axes, slow hop first

    def data_hops(self) -> tuple:
        """The optimizer's hops as (mesh axis, gradient message, parameter message),
        fast hop first: one over 'data', or with a 'dcn' axis two (the slow one
        alone where |data| = 1: a hop over one device sends nothing)."""
        fast = ("data", self.grad_reduce, self.param_gather)
        if "dcn" not in self.data_axes:
            return (fast,)
        slow = ("dcn", self.grad_reduce_dcn, self.param_gather_dcn)
        return (fast, slow) if self.grad_reduce.exists else (slow,)

    def messages(self) -> tuple:
        """The messages that exist, in field order."""
        return tuple(m for f in dataclasses.fields(self)
                     if isinstance(m := getattr(self, f.name), Message) and m.exists)

    def describe(self) -> str:
        """The compressed messages that exist, as AXIS.MESSAGE=CODEC[places],
        e.g. "data.grad_reduce=int4 tensor.block_exit=int8[layers 2-3]"; "none"
        if none."""
        return " ".join(f"{m.axis}.{m.name}={m.describe()}" for m in self.messages()
                        if m.compressed()) or "none"


def plan(pol, n_layers: int, mesh_shape: Mapping[str, int]) -> Plan:
    """The plan of `pol` for a model of `n_layers` layers on a mesh of these sizes
    ({'data', 'tensor', 'pipeline'}, and 'dcn' for a split data axis: then
    'data' is the fast factor's size)."""
    d, t, p = (int(mesh_shape[a]) for a in ("data", "tensor", "pipeline"))
    k = int(mesh_shape.get("dcn", 1))
    split = "dcn" in mesh_shape
    if n_layers % p:
        raise ValueError(f"model.n_layers={n_layers} is not divisible by mesh.pipeline={p}")
    pol.check_places(n_layers, p)

    def one(axis, kind):
        return (codecs.parse(pol[axis, kind]),)

    per_layer = lambda kind: [codecs.parse(pol.codec_at("tensor", kind, layer=i))
                              for i in range(n_layers)]
    at_stage = lambda kind, s: codecs.parse(pol.codec_at("pipeline", kind, stage=s))
    learned = any(_kind(pol["tensor", k]) == "learned" for k in ("act", "act_grad"))
    lowrank = _kind(pol["data", "grad"]) == "lowrank"
    sent = (
        Message("grad_reduce", "data.grad", "update", "all-reduce" if lowrank else "reduce-scatter",
                one("data", "grad"), d, rows="flat"),
        Message("param_gather", "data.param", "update", "all-gather", one("data", "param"), d,
                rows="flat"),
        Message("grad_reduce_dcn", "dcn.grad", "update", "reduce-scatter", one("dcn", "grad"),
                k, rows="flat"),
        Message("param_gather_dcn", "dcn.param", "update", "all-gather", one("dcn", "param"),
                k, rows="flat"),
        Message("ae_grad_sum", "tensor.grad", "update", "all-reduce", one("tensor", "grad"),
                t if learned else 1, rows="flat"),
        Message("embed_sum", "tensor.act", "forward", "all-reduce",
                [_rest(pol["tensor", "act"])], t),
        Message("head_entry_grad", "tensor.act_grad", "backward", "all-reduce",
                [_rest(pol["tensor", "act_grad"])], t),
        Message("block_exit", "tensor.act", "forward", "all-reduce", per_layer("act"), t,
                range(n_layers), "layers"),
        Message("block_entry_grad", "tensor.act_grad", "backward", "all-reduce",
                per_layer("act_grad"), t, range(n_layers), "layers"),
        Message("stage_send", "pipeline.act", "forward", "permute",
                [at_stage("act", s) for s in range(p - 1)], p, range(p - 1), "stages"),
        Message("stage_send_grad", "pipeline.act_grad", "backward", "permute",
                [at_stage("act_grad", s) for s in range(1, p)], p, range(1, p), "stages"),
        Message("last_stage_sum", "pipeline.act", "forward", "all-reduce",
                [at_stage("act", p - 1)], p, (p - 1,), "stages"),
        Message("first_stage_grad", "pipeline.act_grad", "backward", "all-reduce",
                [at_stage("act_grad", 0)], p, (0,), "stages"))
    if split and lowrank:
        raise ValueError(f"compression.data.grad={pol['data', 'grad']}: PowerSGD all-reduces "
                         "over one data axis; it does not run with mesh.dcn_data > 1")
    return Plan(**{m.name: m for m in sent}, error_feedback=bool(pol.error_feedback),
                data_axes=("dcn", "data") if split else ("data",))


def table(pl: Plan) -> list[dict[str, Any]]:
    """One row per message that exists (a report's or a README's table)."""
    return [{"message": m.name, "entry": m.entry, "axis": m.axis, "direction": m.direction,
             "op": m.op, "codec": m.describe(), "rows": m.rows} for m in pl.messages()]
