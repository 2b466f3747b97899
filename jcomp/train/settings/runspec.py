"""What a run is: the config read once (`read`, into frozen values: its plain
sections, its outer loop, its compression) and built into the frozen `RunSpec`
that the training loop reads everything from (`build`).

    run = validate(cfg, n_devices)    # build(read(cfg, n_devices)): UsageError naming the field
    run.model, run.mesh_shape, run.phases, run.plan(phase), run.zero, run.optim.tx(total_steps)

Bad configuration raises `UsageError` (a ValueError) naming the field and what
is allowed; nothing here reads or writes the workdir, so a refused run leaves
it as it was. Only `read` and the modules it calls (this folder) see the
ConfigDict; below them everything is a frozen value. The policy and its
schedule are built once, as config.compression is read
(`jcomp.train.settings.compression`):
`run.phases` is [(first step, policy in force)] from step 0. Below this
folder the step and the optimizer receive a message plan per phase
(`run.plan(phase)`, jcomp.gpt.messages) and the ZeRO layout (`run.zero`, of
the last phase's plan), never a policy or a codec spec string.
compression.auto weighs candidates as variants of the `Settings` (`Settings.
uncompressed`, `with_split`, `with_outer`, `with_decision`), each built again.
"""
from __future__ import annotations

import dataclasses

import jax

from jcomp.gpt import autoencoder, messages, sharding, zero
from jcomp.gpt import mesh as mesh_lib
from jcomp.gpt import model as gpt
from jcomp.gpt import policy as policy_lib
from jcomp.train.outer import fragments as fragments_lib
from jcomp.train.outer import islands as outer_lib
from jcomp.train.run import faults
from jcomp.train.settings import auto as auto_settings
from jcomp.train.settings import compression as compression_lib
from jcomp.train.settings import outer as outerconfig
from jcomp.train.settings import sections as sections_lib
from jcomp.train.settings.sections import DataSettings, OptimSettings, TrainSettings

UsageError = faults.UsageError  # a configuration or input the user must fix


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything the training loop needs to know about a run, checked."""

    model: gpt.ModelConfig
    mesh_shape: tuple          # sizes along mesh_lib.AXES (data: both hops together)
    phases: tuple              # ((first step, Policy), ...) from step 0
    plans: tuple               # the messages.Plan of each phase, in phase order
    zero: zero.Layout          # the train state's ZeRO layout (the last phase's plan)
    optim: OptimSettings
    train: TrainSettings
    data: DataSettings
    checkpoint_every: int
    checkpoint_keep: int
    seed: int
    bucket_bytes: int          # the optimizer's flat buffers, at least 1 byte
    dcn_data: int = 1          # slow-hop groups the data axis is split into (mesh.dcn_data)
    outer: outerconfig.OuterSettings | None = None  # config.outer; None: no outer loop

    @property
    def islands(self) -> int:
        """The outer loop's islands (0 without one): the slow-hop groups with
        mesh.dcn_data > 1, else every data rank."""
        if self.outer is None:
            return 0
        return self.dcn_data if self.dcn_data > 1 else self.mesh_shape[0]

    def mesh_split(self) -> int:
        """The size of the mesh's 'dcn' axis (1: none): the islands, or mesh.dcn_data."""
        return self.islands or self.dcn_data

    def mesh_sizes(self) -> dict:
        """The mesh's axes and sizes (jcomp.gpt.mesh.axis_sizes): with dcn_data > 1
        (or islands) a 'dcn' axis leads and 'data' is the fast factor."""
        return mesh_lib.axis_sizes(self.mesh_shape, self.mesh_split())

    def plan_sizes(self) -> dict:
        """The sizes the message plans are made for: the mesh's, or one island's
        (no 'dcn') with an outer loop."""
        sizes = self.mesh_sizes()
        return {a: n for a, n in sizes.items() if a != mesh_lib.DCN} if self.outer else sizes

    def plan(self, phase) -> messages.Plan:
        """What the train step sends in `phase` (one of `phases`' policies)."""
        return self.plans[[p for _, p in self.phases].index(phase)]

    @property
    def policy(self) -> policy_lib.Policy:
        """The last phase's policy: the one the train state is laid out for."""
        return self.phases[-1][1]

    def step_options(self) -> dict:
        """Keyword arguments of `step.make_train_step` besides the phase's plan."""
        return dict(layout=self.zero, microbatches=self.train.microbatches,
                    clip_norm=float(self.optim.clip_norm), remat=self.train.remat,
                    seed=self.seed, bucket_bytes=self.bucket_bytes,
                    **({"islands": outer_lib.AXIS} if self.outer else {}))

    def fingerprint(self) -> dict:
        """What a checkpoint must have been written for to be restored into this run."""
        return {"model": dataclasses.asdict(self.model), "mesh": list(self.mesh_shape),
                "zero_stage": int(self.zero.stage), "policy": self.policy.as_dict(),
                "error_feedback": bool(self.zero.error_feedback)}


@dataclasses.dataclass(frozen=True)
class Settings:
    """A config read once: its plain sections, its outer loop (None: off) and
    its compression (with compression.auto's fields)."""

    sections: sections_lib.Sections
    outer: outerconfig.OuterSettings | None
    compression: compression_lib.CompressionSettings

    @property
    def auto(self) -> auto_settings.AutoSettings | None:
        return self.compression.auto

    def uncompressed(self) -> "Settings":
        """The run before any choice: error_feedback left to the preset ('on' has
        nothing to feed back until a lossy codec is chosen)."""
        return dataclasses.replace(self, compression=self.compression.rebuilt(
            error_feedback="auto"))

    def with_split(self, k: int) -> "Settings":
        """The data axis split into k slow-hop groups (mesh.dcn_data=k)."""
        sections_lib.check_dcn_data(k, self.sections.shape[0])
        return dataclasses.replace(self, sections=dataclasses.replace(self.sections, dcn_data=k),
                                   compression=self.compression.rebuilt(dcn_data=k))

    def with_outer(self, k: int, every: int) -> "Settings":
        """Training under the outer loop auto weighs: one island per slow-hop group
        (mesh.dcn_data=k), a sync every `every` steps, OUTER_CODEC pseudo-gradients,
        the islands' mean taken (outer lr 1, no momentum)."""
        outer = outerconfig.OuterSettings(every=every, codec=auto_settings.OUTER_CODEC,
                                          error_feedback=False, lr=1.0, momentum=0.0)
        return dataclasses.replace(self.with_split(k), outer=outer)

    def with_decision(self, entries: dict, dcn_data: int = 1, outer_every: int = 0) -> "Settings":
        """The "axis.kind" codecs of a decision set as compression entries, on its
        route: mesh.dcn_data, and its outer loop where it chose one."""
        out = self
        if outer_every:
            out = out.with_outer(dcn_data, outer_every)
        elif dcn_data > 1:
            out = out.with_split(dcn_data)
        return dataclasses.replace(out, compression=out.compression.rebuilt(entries=entries))


def read(cfg, n_devices: int) -> Settings:
    """The config read and checked section by section -> Settings (UsageError
    naming the first field that is wrong)."""
    sections = sections_lib.read(cfg, n_devices)
    return Settings(sections=sections, outer=outerconfig.settings(cfg.get("outer")),
                    compression=compression_lib.from_config(cfg.compression, sections.dcn_data))


def validate(cfg, n_devices: int) -> RunSpec:
    """Checks the whole config before anything runs -> the RunSpec of the run."""
    settings = read(cfg, n_devices)
    return build(settings)


def build(s: Settings) -> RunSpec:
    """Settings -> the RunSpec of the run: what needs several sections at once
    checked (the layout against the mesh, the outer loop against the steps),
    the policy's phases built, a message plan per phase, the ZeRO layout."""
    sec, outer, comp = s.sections, s.outer, s.compression
    shape, dcn_data, model_cfg = sec.shape, sec.dcn_data, sec.model
    split = _islands(outer, shape, dcn_data, comp.hop_entries) if outer else dcn_data
    try:
        mesh_shape = mesh_lib.axis_sizes(shape, split)
        mesh_lib.check_processes(shape, split, jax.process_count())
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    plan_shape = ({a: n for a, n in mesh_shape.items() if a != mesh_lib.DCN} if outer
                  else mesh_shape)
    if outer and outer.every // outer.fragments > sec.train.steps:
        raise UsageError(f"outer.every={outer.every}: no sync would run within train.steps="
                         f"{sec.train.steps} (the first after step "
                         f"{outer.every // outer.fragments}); allowed: outer.every <= "
                         "train.steps (x outer.fragments), or 0")
    try:
        sharding.check_layout(model_cfg, mesh_shape, sec.train.batch_size, sec.train.microbatches)
    except ValueError as e:
        raise UsageError(str(e)) from None
    phases = comp.phases
    pol = phases[-1][1]
    compression_lib.check_reaches_the_run(comp, phases, sec.train.steps)
    try:
        ae = autoencoder.dims(pol)
    except ValueError as e:
        raise UsageError(f"compression.tensor: {e}") from None
    for kind, dim in (("act", ae["out_dim"]), ("act_grad", ae["in_dim"])):
        if dim > model_cfg.d_model:
            raise UsageError(f"compression.tensor.{kind}: ae dim={dim} exceeds "
                             f"model.d_model={model_cfg.d_model}")
    try:
        pol.check_places(model_cfg.n_layers, mesh_shape[mesh_lib.AXES[2]])
    except ValueError as e:
        raise UsageError(f"compression.{e}") from None
    try:
        plans = tuple(messages.plan(p, model_cfg.n_layers, plan_shape) for _, p in phases)
    except ValueError as e:
        raise UsageError(str(e)) from None
    lowrank = [pl.grad_reduce.codec for pl in plans if pl.grad_reduce.codec.kind == "lowrank"]
    if outer and lowrank:
        raise UsageError(f"compression.data.grad={lowrank[0]}: PowerSGD inside the islands of "
                         "an outer loop (outer.every > 0) is not supported; use a byte codec")
    if outer and outer.fragments > 1:
        _check_fragments(outer, model_cfg, pol)
    try:
        layout = zero.for_plan(plans[-1], sec.optim.zero_stage)
        for pl in plans[:-1]:  # every phase runs on the layout; each must fit one too
            zero.for_plan(pl, sec.optim.zero_stage)
    except ValueError as e:
        raise UsageError(f"compression.{'dcn.grad' if dcn_data > 1 else 'data.grad'}: "
                         f"{e}") from None
    compression_lib.check_one_lossy_hop(plans, layout)
    return RunSpec(model=model_cfg, mesh_shape=tuple(shape), phases=phases, plans=plans,
                   zero=layout, optim=sec.optim, train=sec.train, data=sec.data,
                   checkpoint_every=sec.checkpoint_every, checkpoint_keep=sec.checkpoint_keep,
                   seed=sec.seed, bucket_bytes=comp.bucket_bytes, dcn_data=dcn_data,
                   outer=outer)


def _check_fragments(outer, model_cfg, pol):
    """outer.fragments cuts the layers into blocks (`jcomp.train.outer.fragments`):
    checked on the model's abstract init, nothing compiled."""
    shapes = jax.eval_shape(lambda: gpt.init_params(model_cfg, jax.random.key(0),
                                                    coders=autoencoder.coders(pol)))
    try:
        fragments_lib.plan(shapes, outer.fragments)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _islands(outer, shape, dcn_data: int, hop_entries) -> int:
    """The outer loop's islands (mesh.dcn_data's groups, or every data rank), or
    UsageError where the run cannot have them. `hop_entries`: the set
    compression.dcn.* entries, (("dcn.grad", spec), ...)."""
    islands = dcn_data if dcn_data > 1 else shape[0]
    if islands < 2:
        raise UsageError(f"outer.every={outer.every} needs at least 2 islands: mesh.data >= 2 "
                         f"(each data rank an island) or mesh.dcn_data >= 2; got mesh.data="
                         f"{shape[0]}")
    procs = jax.process_count()
    if dcn_data == 1 and procs > 1 and islands != procs:
        # Every island must be one or several whole processes (mesh.check_processes):
        # with each data rank an island, that is one data rank per process.
        ks = " or ".join(f"mesh.dcn_data={k}" for k in range(2, procs + 1) if procs % k == 0)
        fix = (f"set mesh.dcn_data to a divisor of {procs} above 1 ({ks})"
               if shape[0] % procs == 0 else
               f"set mesh.data to a multiple of {procs} and mesh.dcn_data to a divisor of "
               f"{procs} above 1 ({ks})")
        raise UsageError(
            f"outer.every={outer.every} with mesh.dcn_data=1 (no split) makes each of the "
            f"mesh.data={shape[0]} data ranks an island, but in a run of {procs} processes "
            f"every island must be one or several whole processes: {fix}")
    for entry, spec in hop_entries:
        raise UsageError(f"compression.{entry}={spec!r}: with outer.every > 0 no inner "
                         "step crosses between islands; the pseudo-gradient's codec is "
                         "outer.codec (leave it '')")
    return islands
