"""The outer loop of low-communication training (DiLoCo, Streaming DiLoCo) in
the trainer: config.outer, the islands' train state and the sync program.

    outer = settings(cfg.outer)             # UsageError naming the field, or None (off)
    state = lift(step.init_state(...), run, mesh, shapes, tx)  # islands' copies + outer state
    syncs = Syncs(run, mesh, shapes, tx)
    for f in due(done, outer):                    # after inner step `done`
        state, seconds = syncs.run_sync(f, state, done)

Islands. The mesh is ('dcn', 'data', 'tensor', 'pipeline'): each index of
'dcn' is an island (with mesh.dcn_data = k > 1 the k slow-hop groups; with
dcn_data = 1 every data rank, 'data' then of size 1). The inner step
(`jcomp.gpt.step.make_train_step(islands="dcn")`) runs each island's data,
tensor and pipeline parallelism as a run of its own and sends nothing across
'dcn'. Every leaf of the state's "params", "zero" and "skipped" carries a
leading island dimension I (`jcomp.collectives.outer`'s params_IxX).

The sync works on the ZeRO state's float32 master shards (`jcomp.gpt.zero`),
whose layout splits each leaf over 'data' inside an island: `cc.outer_sync`
forms each island's pseudo-gradient anchor - master, averages it across
'dcn' through outer.codec (with error feedback if asked), applies the outer
optimizer (SGD, Nesterov momentum as DiLoCo) to the anchor, and sets every
island's master to the new anchor; the working params are then gathered from
it over 'data' (raw, inside each island). The inner optimizer's state (AdamW
moments) is kept. The outer state is a part of the train state
(state["outer"]: "anchor" and "residual" laid out as the master, "opt" one
outer-optimizer state per fragment) and so checkpointed with it.

Fragments (outer.fragments = F, Streaming DiLoCo): the master's leaves, in
tree order, are cut into F consecutive groups of about equal bytes; fragment f
syncs after the inner steps n with n % H == f * H / F (H = outer.every).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import textwrap
import time

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import codecs
from jcomp import collectives as cc
from jcomp.gpt import sharding, step, zero
from jcomp.meter import wire
from jcomp.train.faults import UsageError
from jcomp.train.traffic import WIDTH, human

AXIS = "dcn"  # the islands' mesh axis
FIELDS = ("every", "codec", "error_feedback", "lr", "momentum", "fragments")
# configs/base.py's outer.*: with every=0 (off) every other field must keep its default.
DEFAULTS = {"every": 0, "codec": "none", "error_feedback": "off", "lr": 1.0, "momentum": 0.0,
            "fragments": 1}
# Codecs that draw (":sr", randk) get fold_in(fold_in(key(seed), KEY_STREAM), step):
# a stream apart from the inner step's, a pure function of the step (resumes draw alike).
KEY_STREAM = 0x5D1


@dataclasses.dataclass(frozen=True)
class OuterSettings:
    """config.outer, checked (`settings`)."""

    every: int           # H: inner steps between two syncs of a fragment
    codec: str           # the pseudo-gradient's codec across islands
    error_feedback: bool
    lr: float
    momentum: float      # Nesterov momentum; 0: none
    fragments: int = 1

    def tx(self):
        """DiLoCo's outer optimizer: SGD, Nesterov momentum where momentum > 0."""
        m = self.momentum
        return optax.sgd(self.lr, momentum=m or None, nesterov=m > 0)

    def record(self) -> dict:
        """What a checkpoint records of them (a resume must not change any)."""
        return {"every": self.every, "codec": self.codec,
                "error_feedback": "on" if self.error_feedback else "off",
                "lr": self.lr, "momentum": self.momentum, "fragments": self.fragments}


def settings(o) -> OuterSettings | None:
    """config.outer -> OuterSettings, or None where outer.every = 0 (off).
    UsageError naming the field and what is allowed; with every = 0 any other
    field away from its default (DEFAULTS) is refused as unused."""
    if o is None:
        return None
    every = o.get("every", 0)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise UsageError(f"outer.every={every!r}; allowed: an integer >= 0 (0: no outer loop)")
    if every == 0:
        _check_unused(o)
        return None
    fragments = o.get("fragments", 1)
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise UsageError(f"outer.fragments={fragments!r}; allowed: an integer >= 1")
    if every % fragments:
        raise UsageError(f"outer.fragments={fragments} does not divide outer.every={every}; "
                         "allowed: a divisor of outer.every (fragment f syncs at steps "
                         "n % every == f * every / fragments)")
    for name, low, high, text in (("lr", 0, None, "> 0"), ("momentum", 0, 1, "in [0, 1)")):
        v = o.get(name)
        ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
              and (v > low if high is None else low <= v < high))
        if not ok:
            raise UsageError(f"outer.{name}={v!r}; allowed: a number {text}")
    spec = o.get("codec", "none")
    try:
        codec = codecs.parse(spec)
    except (TypeError, ValueError) as e:
        raise UsageError(f"outer.codec={spec!r}: {e}") from None
    if codec.kind in ("lowrank", "learned"):
        raise UsageError(f"outer.codec={spec!r}: the pseudo-gradient takes an elementwise or "
                         "sparse codec (none, bf16, int8, int4:rot, topk:F, ...), not "
                         f"{codec.kind} (powersgd, ae)")
    ef = o.get("error_feedback", "off")
    if ef not in ("on", "off"):
        raise UsageError(f"outer.error_feedback={ef!r}; allowed: on, off")
    if ef == "on" and codec.kind == "identity":
        raise UsageError(f"outer.error_feedback='on' has nothing to feed back: outer.codec="
                         f"{spec!r} is lossless; set a lossy codec (e.g. topk:0.03) or 'off'")
    return OuterSettings(every=every, codec=str(spec), error_feedback=ef == "on",
                         lr=float(o.lr), momentum=float(o.momentum), fragments=fragments)


def _check_unused(o):
    """With outer.every=0 no outer loop runs: a field set away from its default
    would be ignored, so it is refused (as compression.dcn.* without a split)."""
    for name in FIELDS[1:]:
        v, default = o.get(name, DEFAULTS[name]), DEFAULTS[name]
        if isinstance(v, bool) or v != default:
            raise UsageError(f"outer.{name}={v!r} applies to an outer loop only, and "
                             "outer.every=0 runs none; set outer.every > 0, or leave "
                             f"outer.{name} at its default {default!r}")


def due(done: int, outer: OuterSettings) -> list[int]:
    """The fragments that sync after inner step `done` (1-based)."""
    if outer is None:
        return []
    stride = outer.every // outer.fragments
    r = done % outer.every
    return [r // stride] if r % stride == 0 else []


def fragments(sizes: list[int], n: int) -> list[list[int]]:
    """Leaf indices cut into `n` consecutive, non-empty groups of about equal
    total size (`sizes`: each leaf's bytes, in tree order): leaf i goes to the
    group its middle byte falls in. ValueError if there are fewer leaves than n."""
    if len(sizes) < n:
        raise ValueError(f"outer.fragments={n}: the model has only {len(sizes)} parameter "
                         f"leaves to group; allowed: 1 to {len(sizes)}")
    total, before, groups = sum(sizes), 0, []
    for i, s in enumerate(sizes):
        g = min(int((before + s / 2) * n // total), n - 1)
        g = max(g, len(groups) - 1 if groups else 0)
        g = min(g, len(groups))                  # never skip a group
        g = max(g, n - (len(sizes) - i))         # leave a leaf for every later group
        if g == len(groups):
            groups.append([])
        groups[g].append(i)
        before += s
    return groups


# ------------------------------------------------------------------ the state

def _master_specs(run, params_shapes, tx):
    specs = sharding.param_specs(params_shapes)
    return specs, zero.state_specs(specs, tx, run.zero)["master"]


def _opt_specs(tx_outer, zspec_leaves):
    dummy = [jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32) for _ in zspec_leaves]
    return optax.tree_map_params(tx_outer, lambda _, s: s, jax.eval_shape(tx_outer.init, dummy),
                                 list(zspec_leaves), transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, P))


def groups_of(run, params_shapes, mesh, tx) -> list[list[int]]:
    """The fragments' master-leaf indices (`fragments` over the master's bytes)."""
    abstract = step.abstract_state(params_shapes, mesh, tx, run.zero)["zero"]["master"]
    sizes = [math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(abstract)]
    try:
        return fragments(sizes, run.outer.fragments)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _outer_specs(run, zspecs, groups):
    """PartitionSpecs of state["outer"]: the anchor laid out as one island's master,
    one outer-optimizer state per fragment likewise, the residuals per island."""
    leaves = jax.tree.leaves(zspecs, is_leaf=_is_spec)
    tx_outer = run.outer.tx()
    out = {"anchor": zspecs,
           "opt": [_opt_specs(tx_outer, [leaves[i] for i in g]) for g in groups]}
    if run.outer.error_feedback:
        out["residual"] = step.island_specs(zspecs, AXIS)
    return out


def lift(single, run, mesh, params_shapes, tx):
    """A one-island train state (`step.init_state` on the mesh, replicated over
    'dcn') -> every island's copy of it, with the outer state: the anchor is the
    master, the outer optimizer freshly initialised, the residuals zeros."""
    specs, zspecs = _master_specs(run, params_shapes, tx)
    single_specs = step.state_specs(specs, tx, run.zero)
    flat, treedef = jax.tree.flatten(single)
    flat_specs = treedef.flatten_up_to(single_specs)
    copies = jax.jit(jax.shard_map(
        lambda xs: [x[None] for x in xs], mesh=mesh, in_specs=(flat_specs,),
        out_specs=[P(AXIS, *s) for s in flat_specs]))(flat)
    state = jax.tree.unflatten(treedef, copies)
    groups = groups_of(run, params_shapes, mesh, tx)
    ospecs = _outer_specs(run, zspecs, groups)
    named = lambda s: NamedSharding(mesh, s)
    tx_outer = run.outer.tx()

    def make(master, master_IxX):
        leaves = jax.tree.leaves(master)
        out = {"anchor": jax.tree.map(jnp.copy, master),
               "opt": [tx_outer.init([leaves[i] for i in g]) for g in groups]}
        if run.outer.error_feedback:
            out["residual"] = jax.tree.map(jnp.zeros_like, master_IxX)
        return out
    outer = jax.jit(make, out_shardings=jax.tree.map(named, ospecs, is_leaf=_is_spec))(
        single["zero"]["master"], state["zero"]["master"])
    return {**state, "outer": outer}


def _is_spec(x):
    return isinstance(x, P)


def abstract_state(run, params_shapes, mesh, tx) -> dict:
    """The outer run's train state as ShapeDtypeStructs with shardings (the
    checkpoint's restore target)."""
    single = step.abstract_state(params_shapes, mesh, tx, run.zero)
    islands = mesh.shape[AXIS]
    lifted = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        (islands,) + a.shape, a.dtype, sharding=NamedSharding(mesh, P(AXIS, *a.sharding.spec))),
        single)
    specs, zspecs = _master_specs(run, params_shapes, tx)
    groups = groups_of(run, params_shapes, mesh, tx)
    ospecs = _outer_specs(run, zspecs, groups)
    master = jax.tree.leaves(single["zero"]["master"])
    tx_outer = run.outer.tx()
    shapes = {"anchor": single["zero"]["master"],
              "opt": [jax.eval_shape(tx_outer.init, [master[i] for i in g]) for g in groups]}
    if run.outer.error_feedback:
        shapes["residual"] = lifted["zero"]["master"]
    outer = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=NamedSharding(mesh, s)),
                         shapes, ospecs)
    return {**lifted, "outer": outer}


# ------------------------------------------------------------------- the sync

def make_sync(run, mesh, params_shapes, tx, fragment: int, groups):
    """A jitted fn(state, step int32) -> state: fragment `fragment` of every
    island's master synced (`cc.outer_sync`), its working params gathered anew."""
    o = run.outer
    specs, zspecs = _master_specs(run, params_shapes, tx)
    zleaves, ztree = jax.tree.flatten(zspecs, is_leaf=_is_spec)
    pleaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    idx = groups[fragment]
    tx_outer = o.tx()
    needs_key = codecs.parse(o.codec).needs_key
    shapes = jax.tree.leaves(params_shapes)
    sizes = dict(mesh.shape)

    def gather(i, master_IxX):
        """[I, d, T', P', c] master -> [I, ...] working params of leaf i (raw over 'data')."""
        shape = zero._local_shape(shapes[i].shape, pleaves[i], sizes)
        dtype = shapes[i].dtype

        def body(m):
            full = lax.all_gather(m[0].reshape(-1), "data", axis=0, tiled=True, to="invarying")
            return full[:math.prod(shape)].reshape(shape).astype(dtype)[None]
        return jax.shard_map(body, mesh=mesh, in_specs=P(AXIS, *zleaves[i]),
                             out_specs=P(AXIS, *pleaves[i]))(master_IxX)

    def sync(state, step_no):
        masters = jax.tree.leaves(state["zero"]["master"])
        anchor = jax.tree.leaves(state["outer"]["anchor"])
        fed = "residual" in state["outer"]
        res = jax.tree.leaves(state["outer"]["residual"]) if fed else None
        ost = cc.OuterState([anchor[i] for i in idx], state["outer"]["opt"][fragment],
                            [res[i] for i in idx] if fed else None)
        key = (jax.random.fold_in(jax.random.fold_in(jax.random.key(run.seed), KEY_STREAM),
                                  step_no) if needs_key else None)
        new_m, new_ost = cc.outer_sync([masters[i] for i in idx], ost, tx=tx_outer, mesh=mesh,
                                       axis=AXIS, codec=o.codec,
                                       param_specs=[zleaves[i] for i in idx], key=key,
                                       bucket_bytes=run.bucket_bytes)
        params, ptree = jax.tree.flatten(state["params"])
        for j, i in enumerate(idx):
            masters[i], anchor[i] = new_m[j], new_ost.anchor[j]
            params[i] = gather(i, new_m[j])
            if fed:
                res[i] = new_ost.residual[j]
        opt = list(state["outer"]["opt"])
        opt[fragment] = new_ost.opt_state
        outer = {"anchor": jax.tree.unflatten(ztree, anchor), "opt": opt}
        if fed:
            outer["residual"] = jax.tree.unflatten(ztree, res)
        zstate = {**state["zero"], "master": jax.tree.unflatten(ztree, masters)}
        return {**state, "params": jax.tree.unflatten(ptree, params), "zero": zstate,
                "outer": outer}

    return jax.jit(sync, donate_argnums=0)


class Syncs:
    """The compiled sync of every fragment, compiled all at once when the first
    is needed (each one's bytes across islands read from its program)."""

    def __init__(self, run, mesh, params_shapes, tx):
        self.run, self.mesh, self.shapes, self.tx = run, mesh, params_shapes, tx
        self.groups = groups_of(run, params_shapes, mesh, tx)
        self._exe: list = []
        self.bytes_per_sync: list[float] = []  # per fragment, sent per device across islands

    def prepare(self, state):
        """Compiles every fragment's sync for `state` (once)."""
        if not self._exe:
            self._compile(state)

    def start_line(self, inner_bytes: float) -> str:
        """What a run prints under its start table (after `prepare`)."""
        o = self.run.outer
        frag = f", {o.fragments} fragments in turn" if o.fragments > 1 else ""
        return textwrap.fill(
            f"Outer loop: {self.run.islands} islands, each fragment synced every {o.every} "
                f"steps{frag}, pseudo-gradients {o.codec}: {human(sum(self.bytes_per_sync))} "
                f"per {o.every} steps across islands per device "
                f"({human(self.bytes_per_step())} per inner step; the inner step sends "
                f"{human(inner_bytes)} across islands).", WIDTH, subsequent_indent="  ")

    def _compile(self, state):
        step_no = jnp.zeros((), jnp.int32)
        for f in range(self.run.outer.fragments):
            fn = make_sync(self.run, self.mesh, self.shapes, self.tx, f, self.groups)
            exe = fn.lower(state, step_no).compile()
            self._exe.append(exe)
            self.bytes_per_sync.append(float(
                wire.measure_compiled(exe, self.mesh).by_axis().get(AXIS, 0.0)))

    def bytes_per_step(self) -> float:
        """Bytes per device across islands per inner step, averaged over H (the
        inner steps send none)."""
        return sum(self.bytes_per_sync) / self.run.outer.every

    def run_sync(self, fragment: int, state, done: int):
        """-> (state after fragment `fragment`'s sync after step `done`, seconds)."""
        self.prepare(state)
        t0 = time.perf_counter()
        state = self._exe[fragment](state, jnp.asarray(done, jnp.int32))
        jax.block_until_ready(state)
        return state, time.perf_counter() - t0


@functools.cache
def _reducer():
    return jax.jit(lambda m: {k: (jnp.sum(v) if k == "skipped" else
                                  jnp.all(v) if v.dtype == jnp.bool_ else jnp.mean(v))
                              for k, v in m.items()})


def island_mean(metrics: dict) -> dict:
    """The islands' [I] metrics as one value each: the mean (all for "finite",
    the sum for "skipped"), in a small program of its own (the inner step sends
    nothing across islands)."""
    return _reducer()(metrics)
