"""The outer loop of low-communication training (DiLoCo, Streaming DiLoCo) in
the trainer: the islands' train state and the sync program (config.outer is
read by `jcomp.train.settings.outer`; the loop asks `jcomp.train.outer.driver`).

    state = lift(step.init_state(...), run, mesh, shapes, tx)  # islands' copies + outer state
    syncs = delay.syncs_for(run, mesh, shapes, tx)  # Syncs, or DelayedSyncs
    for f in fragments.applied(done, run.outer):  # with outer.delay: merged now
        state, seconds = syncs.run_apply(f, state)
    for f in fragments.due(done, run.outer):    # after inner step `done`
        state, seconds = syncs.run_sync(f, state, done)

Islands. The mesh is ('dcn', 'data', 'tensor', 'pipeline'): each index of
'dcn' is an island (with mesh.dcn_data = k > 1 the k slow-hop groups; with
dcn_data = 1 every data rank, 'data' then of size 1). The inner step
(`jcomp.gpt.step.make_train_step(islands="dcn")`) runs each island's data,
tensor and pipeline parallelism as a run of its own and sends nothing across
'dcn'. Every leaf of the state's "params", "zero" and "skipped" carries a
leading island dimension I (`jcomp.collectives.outer.sync`'s params_IxX).

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

Fragments (outer.fragments = F, Streaming DiLoCo): contiguous blocks of
transformer layers, the embedding with the first and the final norm with the
last (`jcomp.train.outer.fragments`); fragment f syncs after the inner steps
n with n % H == f * H / F (H = outer.every). The global model is the anchor
(`Syncs.global_params`): the loop evaluates it as val_loss, beside the
islands' own params (val_loss_islands).

Delay (outer.delay = tau > 0, Streaming DiLoCo's overlap): a sync starts
after its step, in the next step's program, and is merged into the islands
tau steps later (`jcomp.train.outer.delay`). With delay 0 the sync blocks, as
without it.

outer.codec="sparseloco[:k=K][:chunk=C][:beta=B][:coder=packed|index]" is
SparseLoCo (`jcomp.collectives.outer.sparseloco`): chunked top-k, 2-bit
values, a decaying residual per island, no outer momentum.
"""
from __future__ import annotations

import functools
import textwrap
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import codecs
from jcomp import collectives as cc
from jcomp.gpt import sharding, step, zero
from jcomp.meter import wire
from jcomp.train.outer import fragments
from jcomp.train.run.faults import UsageError
from jcomp.train.run.traffic import WIDTH, human

AXIS = "dcn"  # the islands' mesh axis
# Codecs that draw (":sr", randk) get `sync_key`: a stream apart from the inner
# step's, a pure function of the step and the fragment, so that a resumed run
# draws what the uninterrupted one did and no two syncs draw alike.
KEY_STREAM = 0x5D1


def sync_key(seed: int, step_no, fragment: int):
    """The key of fragment `fragment`'s sync after inner step `step_no`:
    fold_in(fold_in(fold_in(key(seed), KEY_STREAM), step_no), fragment)."""
    key = jax.random.fold_in(jax.random.key(seed), KEY_STREAM)
    return jax.random.fold_in(jax.random.fold_in(key, step_no), fragment)


def draws(codec) -> bool:
    """Whether outer codec `codec` (a spec, a Codec or a SparseLoCo) needs a key."""
    if isinstance(codec, cc.SparseLoCo):
        return False
    return codecs.parse(codec).needs_key


# ------------------------------------------------------------------ the state

def master_specs(run, params_shapes, tx):
    specs = sharding.param_specs(params_shapes)
    return specs, zero.state_specs(specs, tx, run.zero)["master"]


def _opt_specs(tx_outer, zspec_leaves):
    dummy = [jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32) for _ in zspec_leaves]
    return optax.tree_map_params(tx_outer, lambda _, s: s, jax.eval_shape(tx_outer.init, dummy),
                                 list(zspec_leaves), transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, P))


def plan_of(run, params_shapes) -> list[list[fragments.Part]]:
    """The fragments' parts (`jcomp.train.outer.fragments.plan`): blocks of layers."""
    try:
        return fragments.plan(params_shapes, run.outer.fragments)
    except ValueError as e:
        raise UsageError(str(e)) from None


def part_shapes(run, params_shapes, mesh, tx, parts):
    """-> [(shape, dtype, spec)] of each part's anchor (no island dimension): a
    whole leaf as the master stores it, a slice in the parameter's layout."""
    abstract = jax.tree.leaves(
        step.abstract_state(params_shapes, mesh, tx, run.zero)["zero"]["master"])
    specs, zspecs = master_specs(run, params_shapes, tx)
    zleaves = jax.tree.leaves(zspecs, is_leaf=is_spec)
    pleaves = jax.tree.leaves(specs, is_leaf=is_spec)
    shapes = jax.tree.leaves(params_shapes)
    out = []
    for part in parts:
        i = part.leaf
        if part.layers is None:
            out.append((abstract[i].shape, jnp.float32, zleaves[i]))
        else:
            n = part.layers[1] - part.layers[0]
            out.append(((n, *shapes[i].shape[1:]), jnp.float32,
                        fragments.slice_spec(pleaves[i], n, dict(mesh.shape))))
    return out


def _outer_specs(run, zspecs, infos):
    """PartitionSpecs of state["outer"]: the anchor laid out as one island's master,
    one outer-optimizer state per fragment (laid out as its parts), the
    residuals per island."""
    tx_outer = run.outer.tx()
    out = {"anchor": zspecs,
           "opt": [_opt_specs(tx_outer, [s for _, _, s in info]) for info in infos]}
    if run.outer.error_feedback:
        out["residual"] = step.island_specs(zspecs, AXIS)
    return out


def _infos(run, params_shapes, mesh, tx):
    return [part_shapes(run, params_shapes, mesh, tx, parts) for parts in plan_of(run, params_shapes)]


def _opt_init(tx_outer, info):
    return tx_outer.init([jnp.zeros(shape, dtype) for shape, dtype, _ in info])


def lift(single, run, mesh, params_shapes, tx):
    """A one-island train state (`step.init_state` on the mesh, replicated over
    'dcn') -> every island's copy of it, with the outer state: the anchor is the
    master, the outer optimizer freshly initialised, the residuals zeros."""
    specs, zspecs = master_specs(run, params_shapes, tx)
    single_specs = step.state_specs(specs, tx, run.zero)
    flat, treedef = jax.tree.flatten(single)
    flat_specs = treedef.flatten_up_to(single_specs)
    copies = jax.jit(jax.shard_map(
        lambda xs: [x[None] for x in xs], mesh=mesh, in_specs=(flat_specs,),
        out_specs=[P(AXIS, *s) for s in flat_specs]))(flat)
    state = jax.tree.unflatten(treedef, copies)
    infos = _infos(run, params_shapes, mesh, tx)
    ospecs = _outer_specs(run, zspecs, infos)
    named = lambda s: NamedSharding(mesh, s)
    tx_outer = run.outer.tx()

    def make(master, master_IxX):
        out = {"anchor": jax.tree.map(jnp.copy, master),
               "opt": [_opt_init(tx_outer, info) for info in infos]}
        if run.outer.error_feedback:
            out["residual"] = jax.tree.map(jnp.zeros_like, master_IxX)
        return out
    outer = jax.jit(make, out_shardings=jax.tree.map(named, ospecs, is_leaf=is_spec))(
        single["zero"]["master"], state["zero"]["master"])
    return {**state, "outer": outer}


def is_spec(x):
    return isinstance(x, P)


def inner_state(state) -> dict:
    """What an inner step takes: the train state less the outer loop's part."""
    return {k: v for k, v in state.items() if k != "outer"}


def abstract_state(run, params_shapes, mesh, tx) -> dict:
    """The outer run's train state as ShapeDtypeStructs with shardings (the
    checkpoint's restore target)."""
    single = step.abstract_state(params_shapes, mesh, tx, run.zero)
    islands = mesh.shape[AXIS]
    lifted = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        (islands,) + a.shape, a.dtype, sharding=NamedSharding(mesh, P(AXIS, *a.sharding.spec))),
        single)
    specs, zspecs = master_specs(run, params_shapes, tx)
    infos = _infos(run, params_shapes, mesh, tx)
    ospecs = _outer_specs(run, zspecs, infos)
    tx_outer = run.outer.tx()
    shapes = {"anchor": single["zero"]["master"],
              "opt": [jax.eval_shape(functools.partial(_opt_init, tx_outer, info))
                      for info in infos]}
    if run.outer.error_feedback:
        shapes["residual"] = lifted["zero"]["master"]
    outer = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=NamedSharding(mesh, s)),
                         shapes, ospecs)
    return {**lifted, "outer": outer}


# ------------------------------------------------------------------- the sync

def make_sync(run, mesh, params_shapes, tx, fragment: int, stage: str = "sync"):
    """fn(state, step int32) -> state: fragment `fragment` of every island's
    master synced (`cc.outer_sync`), its working params gathered anew. Whole
    leaves sync in the master's layout; a block of layers in the parameters'
    (`jcomp.train.outer.fragments`). stage="start": the outer state stepped (anchor,
    residuals, optimizer), the islands' masters and params left as they are
    (merged later: `jcomp.train.outer.delay`)."""
    o = run.outer
    specs, zspecs = master_specs(run, params_shapes, tx)
    zleaves, ztree = jax.tree.flatten(zspecs, is_leaf=is_spec)
    pleaves = jax.tree.leaves(specs, is_leaf=is_spec)
    parts = plan_of(run, params_shapes)[fragment]
    info = part_shapes(run, params_shapes, mesh, tx, parts)
    tx_outer = o.tx()
    codec = o.codec_object()
    # The codec is a spec string here: ask the parsed codec, not the string.
    needs_key = draws(codec)
    shapes = jax.tree.leaves(params_shapes)
    multiple = run.zero.multiple

    def param_view(i, x, lead):
        return fragments.to_param(x, pleaves[i], zleaves[i], shapes[i].shape, mesh,
                                  AXIS if lead else None)

    def zero_view(i, x, lead):
        return fragments.to_zero(x, pleaves[i], zleaves[i], multiple, mesh,
                                 AXIS if lead else None)

    def sync(state, step_no):
        masters = jax.tree.leaves(state["zero"]["master"])
        anchor = jax.tree.leaves(state["outer"]["anchor"])
        fed = "residual" in state["outer"]
        res = jax.tree.leaves(state["outer"]["residual"]) if fed else None
        full = {}  # leaf -> (master, anchor, residual) in the parameter's layout

        def cut(part):
            i = part.leaf
            if part.layers is None:
                return masters[i], anchor[i], (res[i] if fed else None)
            a, b = part.layers
            full[i] = (param_view(i, masters[i], True), param_view(i, anchor[i], False),
                       param_view(i, res[i], True) if fed else None)
            m, an, r = full[i]
            return m[:, a:b], an[a:b], (None if r is None else r[:, a:b])
        cuts = [cut(p) for p in parts]
        ost = cc.OuterState([c[1] for c in cuts], state["outer"]["opt"][fragment],
                            [c[2] for c in cuts] if fed else None)
        key = sync_key(run.seed, step_no, fragment) if needs_key else None
        new_m, new_ost = cc.outer_sync([c[0] for c in cuts], ost, tx=tx_outer, mesh=mesh,
                                       axis=AXIS, codec=codec,
                                       param_specs=[s for _, _, s in info], key=key,
                                       bucket_bytes=run.bucket_bytes)
        params, ptree = jax.tree.flatten(state["params"])
        for j, part in enumerate(parts):
            i = part.leaf
            if part.layers is None:
                anchor[i] = new_ost.anchor[j]
                if stage == "sync":
                    masters[i] = new_m[j]
                    params[i] = cast_islands(param_view(i, new_m[j], True), shapes[i].dtype,
                                      pleaves[i], mesh)
                if fed:
                    res[i] = new_ost.residual[j]
                continue
            a, b = part.layers
            m, an, r = full[i]
            if stage == "sync":
                m = m.at[:, a:b].set(new_m[j])
                masters[i] = zero_view(i, m, True)
            anchor[i] = zero_view(i, an.at[a:b].set(new_ost.anchor[j]), False)
            if stage == "sync":
                params[i] = cast_islands(m, shapes[i].dtype, pleaves[i], mesh)
            if fed:
                res[i] = zero_view(i, r.at[:, a:b].set(new_ost.residual[j]), True)
        opt = list(state["outer"]["opt"])
        opt[fragment] = new_ost.opt_state
        outer = {"anchor": jax.tree.unflatten(ztree, anchor), "opt": opt}
        if fed:
            outer["residual"] = jax.tree.unflatten(ztree, res)
        zstate = {**state["zero"], "master": jax.tree.unflatten(ztree, masters)}
        return {**state, "params": jax.tree.unflatten(ptree, params), "zero": zstate,
                "outer": outer}

    return sync


def cast_islands(x_IxX, dtype, pspec, mesh):
    """float32 [I, ...] in the parameter's layout -> the working params' dtype."""
    return jax.shard_map(lambda v: v.astype(dtype), mesh=mesh, in_specs=P(AXIS, *pspec),
                         out_specs=P(AXIS, *pspec))(x_IxX)


def make_global_params(run, mesh, params_shapes, tx):
    """A jitted fn(state) -> every island's copy of the anchor as working params
    ([I, ...] in the params' dtypes): the global model, for evaluation."""
    specs, zspecs = master_specs(run, params_shapes, tx)
    zleaves = jax.tree.leaves(zspecs, is_leaf=is_spec)
    pleaves, ptree = jax.tree.flatten(specs, is_leaf=is_spec)
    shapes = jax.tree.leaves(params_shapes)

    def one(i, a):
        full = fragments.to_param(a, pleaves[i], zleaves[i], shapes[i].shape, mesh)
        return jax.shard_map(lambda v: v.astype(shapes[i].dtype)[None], mesh=mesh,
                             in_specs=pleaves[i], out_specs=P(AXIS, *pleaves[i]))(full)

    def fn(state):
        anchor = jax.tree.leaves(state["outer"]["anchor"])
        return jax.tree.unflatten(ptree, [one(i, a) for i, a in enumerate(anchor)])
    return jax.jit(fn)


class Syncs:
    """The compiled sync of every fragment, compiled all at once when the first
    is needed (each one's bytes across islands read from its program)."""

    def __init__(self, run, mesh, params_shapes, tx):
        self.run, self.mesh, self.shapes, self.tx = run, mesh, params_shapes, tx
        self.plan = plan_of(run, params_shapes)
        self._exe: list = []    # per fragment: the sync, or with outer.delay its start
        self._apply: list = []  # per fragment, with outer.delay: the merge
        self._global = None
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
            fn = make_sync(self.run, self.mesh, self.shapes, self.tx, f)
            # The state keeps its layout, so that the compiled train step takes it.
            keep = jax.tree.map(lambda x: x.sharding, state)
            exe = jax.jit(fn, donate_argnums=0, out_shardings=keep).lower(
                state, step_no).compile()
            self._exe.append(exe)
            self.bytes_per_sync.append(float(
                wire.measure_compiled(exe, self.mesh).by_axis().get(AXIS, 0.0)))

    def bytes_per_step(self) -> float:
        """Bytes per device across islands per inner step, averaged over H (the
        inner steps send none)."""
        return sum(self.bytes_per_sync) / self.run.outer.every

    def run_sync(self, fragment: int, state, done: int):
        """-> (state after fragment `fragment`'s sync after step `done`, seconds).
        With outer.delay: its start, run alone (after an evaluated or the last
        step; the others ride in the next step's program, `outerdelay.carry`)."""
        self.prepare(state)
        t0 = time.perf_counter()
        if self.run.outer.delay:
            rest = inner_state(state)
            outer = self._exe[fragment](state["outer"], rest, jnp.asarray(done, jnp.int32))
            state = {**state, "outer": outer}
            jax.block_until_ready(outer)
            return state, time.perf_counter() - t0
        state = self._exe[fragment](state, jnp.asarray(done, jnp.int32))
        jax.block_until_ready(state)
        return state, time.perf_counter() - t0

    def run_apply(self, fragment: int, state):
        """-> (state with fragment `fragment`'s started sync merged, seconds: the
        wait for its result included)."""
        self.prepare(state)
        t0 = time.perf_counter()
        state = self._apply[fragment](state)
        jax.block_until_ready(state)
        return state, time.perf_counter() - t0

    def global_params(self, state):
        """The global model (the anchor) as every island's working params."""
        if self._global is None:
            self._global = make_global_params(self.run, self.mesh, self.shapes, self.tx)
        return self._global(state)

