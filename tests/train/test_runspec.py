"""Tests for jcomp.train.settings.runspec: a config checked once into a frozen RunSpec
(phases, their message plans, the ZeRO layout, the settings the loop reads),
and the UsageError naming the field of a config it refuses."""
import dataclasses
import inspect
import json

import pytest

from jcomp import codecs
from jcomp.gpt import policy as policy_lib
from jcomp.gpt import schedule as schedule_lib
from jcomp.gpt import step, zero
from jcomp.train.settings import runspec, sections
from tests.train.tinyconfig import tiny_config

_tiny = tiny_config


# ---------------------------------------------------------------- refusals

def _assert_refused(overrides, named):
    """tiny's config with `overrides` is refused by a UsageError naming all of `named`."""
    with pytest.raises(runspec.UsageError) as e:
        runspec.validate(_tiny(**overrides), 8)
    for n in named:
        assert n in str(e.value), (n, str(e.value))


@pytest.mark.parametrize("overrides,named", [
    ({"compression.error_feedback": "on"},
     ["compression.error_feedback='on'", "nothing to feed back", "compression.data.grad"]),
    ({"data.token_dtype": "uint16"}, ["data.token_dtype='uint16'", "tokens:", "token_dtype=''"]),
    ({"data.source": "tokens:/x.bin", "data.token_dtype": "uint16"},
     ["data.tokenizer='bytes'", "--config.data.tokenizer=''"]),
    ({"compression.data.grad": "int8", "compression.schedule.data.grad": "@20"},
     ["compression.schedule", "step 20", "train.steps=12"]),
    ({"train.nonfinite_limit": 0}, ["train.nonfinite_limit", "> 0"]),
])
def test_settings_no_step_would_use_are_refused(overrides, named):
    _assert_refused(overrides, named)


def test_error_feedback_on_with_a_lossy_codec_is_accepted():
    """The refusal above is about having nothing to feed back, not about 'on'."""
    spec = runspec.validate(_tiny(**{"compression.error_feedback": "on",
                                     "compression.data.grad": "int8"}), 8)
    assert spec.zero.error_feedback


def test_usage_error_is_a_value_error():
    """Callers that catch ValueError (bad input) catch a refused config too."""
    assert issubclass(runspec.UsageError, ValueError)


@pytest.mark.parametrize("overrides,named", [
    # tiny: mesh (2, 2, 2), batch_size 8, microbatches 2, steps 12, d_model 32,
    # n_layers 2, max_seq_len 32
    ({"train.batch_size": 6},
     ["train.batch_size=6", "not divisible", "mesh.data x train.microbatches = 2 x 2 = 4"]),
    ({"compression.policy": "fancy"},
     ["compression.policy='fancy'", "baseline, naive, hybrid, hybrid_paper"]),
    ({"compression.data.grad": "int9"}, ["compression.data.grad", "int9"]),
    ({"compression.error_feedback": "maybe"},
     ["compression.error_feedback='maybe'", "auto, on, off"]),
    ({"optim.zero_stage": 3}, ["optim.zero_stage=3", "1, 2"]),
    ({"optim.name": "lamb"}, ["optim.name='lamb'", "adamw, sgd"]),
    ({"train.nonfinite": "ignore"}, ["train.nonfinite='ignore'", "skip, stop"]),
    ({"optim.lr": 0.0}, ["optim.lr must be > 0"]),
    ({"compression.bucket_mib": float("inf")}, ["compression.bucket_mib must be > 0; got inf"]),
    ({"train.steps": True}, ["train.steps must be an integer"]),  # a bool is not a count
    ({"seed": -1}, ["seed must be >= 0"]),
    ({"seed": 2**63}, ["seed must be <= ", "2**63 - 1"]),
    ({"data.seq_len": 64}, ["data.seq_len=64 exceeds model.max_seq_len=32"]),
    ({"data.source": "  "}, ["data.source='  '", "names no corpus"]),
    ({"mesh.data": 3}, ["mesh:", "12 devices", "8 devices are available"]),
    ({"model.n_heads": 3}, ["model.d_model (32)", "n_heads (3)"]),
    ({"train.profile_steps": "5-50"}, ["train.profile_steps='5-50'", "train.steps (12)"]),
    # stochastic rounding draws random numbers: only data.grad and data.param get a key
    ({"compression.tensor.act": "int8:sr"},
     ["compression.tensor.act=", "data.grad and data.param only"]),
    ({"compression.tensor.act": "int8", "compression.layers.tensor.act": "5"},
     ["compression.layers.tensor.act=5", "2 layers"]),
    ({"compression.tensor.act": "ae:dim=64"},
     ["compression.tensor.act", "ae dim=64 exceeds model.d_model=32"]),
    ({"compression.data.grad": "powersgd:rank=2", "optim.zero_stage": 2},
     ["compression.data.grad", "optim.zero_stage=1"]),
    ({"compression.policy": "hybrid", "compression.warmup_steps": 12},
     ["compression.warmup_steps=12", "train.steps=12"]),
])
def test_a_bad_field_is_refused_by_name(overrides, named):
    _assert_refused(overrides, named)


def test_warmup_steps_below_train_steps_is_accepted():
    """The refusal above is about warm-up reaching the end of the run: one step
    before it, the last step is compressed."""
    run = runspec.validate(_tiny(**{"compression.policy": "hybrid",
                                    "compression.warmup_steps": 11}), 8)
    assert [s for s, _ in run.phases] == [0, 11]


# ---------------------------------------------------------------- the RunSpec

def test_tiny_config_gives_its_settings():
    run = runspec.validate(_tiny(), 8)
    assert run.mesh_shape == (2, 2, 2)
    assert (run.model.d_model, run.model.n_layers, run.model.max_seq_len) == (32, 2, 32)
    assert (run.train.steps, run.train.batch_size, run.train.microbatches) == (12, 8, 2)
    assert (run.train.log_every, run.train.eval_every, run.train.profile_steps) == (2, 6, None)
    assert (run.optim.name, run.optim.lr, run.optim.warmup_steps, run.optim.zero_stage) == (
        "adamw", 1e-2, 2, 1)
    assert (run.checkpoint_every, run.checkpoint_keep, run.seed) == (4, 2, 0)
    # a text source: a tokenizer, no token dtype
    assert (run.data.source, run.data.tokens, run.data.tokenizer, run.data.token_dtype) == (
        "kjv", False, "bytes", None)
    assert run.bucket_bytes == 32 * 2**20  # bucket_mib=32.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 1


def test_a_mesh_axis_of_minus_one_takes_the_remaining_devices():
    # 16 devices over tensor 2 x pipeline 2 leave 4 for data; batch 8 = 4 x 2 microbatches
    assert runspec.validate(_tiny(**{"mesh.data": -1}), 16).mesh_shape == (4, 2, 2)


def test_token_source_keeps_its_dtype_and_drops_the_tokenizer():
    run = runspec.validate(_tiny(**{"data.source": "tokens:/x.bin", "data.tokenizer": "",
                                    "data.token_dtype": "uint16"}), 8)
    assert (run.data.tokens, run.data.tokenizer, run.data.token_dtype) == (True, None, "uint16")


def test_profile_steps_are_parsed_to_first_and_last():
    assert runspec.validate(_tiny(**{"train.profile_steps": "3-5"}), 8).train.profile_steps == (3, 5)


def test_bucket_bytes_are_at_least_one():
    assert runspec.validate(_tiny(**{"compression.bucket_mib": 0.5}), 8).bucket_bytes == 2**19
    assert runspec.validate(_tiny(**{"compression.bucket_mib": 1e-9}), 8).bucket_bytes == 1


def test_baseline_is_one_uncompressed_phase_with_a_plain_layout():
    run = runspec.validate(_tiny(), 8)
    assert run.phases == ((0, policy_lib.preset("baseline")),)
    assert run.policy == policy_lib.preset("baseline")
    assert run.plan(run.policy).describe() == "none"
    assert isinstance(run.zero, zero.Layout)
    assert run.zero == zero.Layout(stage=1, error_feedback=False, powersgd=None, multiple=1)


# int4 and int8 quantize blocks of 256 (int4 packs 2 per byte: lcm(256, 2) = 256),
# so every lossy preset's shards are multiples of 256; hybrid keeps no residuals
@pytest.mark.parametrize("preset,grad,param,ef", [
    ("hybrid", "int4:rot", "int8", False),
    ("naive", "int4", "int4", True),
    ("hybrid_paper", "int4", "int8", True),
])
def test_preset_plan_and_layout_follow_the_policy(preset, grad, param, ef):
    run = runspec.validate(_tiny(**{"compression.policy": preset}), 8)
    assert run.policy == policy_lib.preset(preset)
    assert len(run.phases) == 1
    plan = run.plan(run.policy)
    assert (plan.grad_reduce.codec, plan.param_gather.codec) == (codecs.parse(grad),
                                                                 codecs.parse(param))
    assert plan.error_feedback is ef
    assert run.zero == zero.Layout(stage=1, error_feedback=ef, powersgd=None, multiple=256)


def test_error_feedback_and_zero_stage_switches_reach_the_layout():
    on = runspec.validate(_tiny(**{"compression.policy": "hybrid",
                                   "compression.error_feedback": "on",
                                   "optim.zero_stage": 2}), 8)
    assert on.policy.error_feedback and on.zero.error_feedback and on.zero.stage == 2
    off = runspec.validate(_tiny(**{"compression.policy": "naive",
                                    "compression.error_feedback": "off"}), 8)
    assert not off.policy.error_feedback and not off.zero.error_feedback


def test_powersgd_layout_keeps_its_codec():
    run = runspec.validate(_tiny(**{"compression.data.grad": "powersgd:rank=2"}), 8)
    assert run.zero.powersgd == codecs.parse("powersgd:rank=2")
    assert run.plan(run.policy).grad_reduce.op == "all-reduce"  # factors are all-reduced


def test_a_schedule_gives_phases_each_with_its_plan():
    """data.grad int8 from the start, tensor.act int8 from step 4: two phases; the
    layout is the last phase's."""
    run = runspec.validate(_tiny(**{"compression.data.grad": "int8",
                                    "compression.tensor.act": "int8",
                                    "compression.schedule.tensor.act": "@4"}), 8)
    assert [s for s, _ in run.phases] == [0, 4]
    first, last = (p for _, p in run.phases)
    assert run.policy is last
    assert str(first["tensor", "act"]) == "none" and str(last["tensor", "act"]) == "int8"
    assert run.plan(first).describe() == "data.grad_reduce=int8"
    assert not run.plan(first).block_exit.compressed()
    assert run.plan(last).block_exit.compressed()
    assert run.plan(last).block_exit.codecs == (codecs.parse("int8"),) * 2  # both layers
    assert run.zero.multiple == 256


def test_warmup_starts_the_policy_at_its_step():
    run = runspec.validate(_tiny(**{"compression.policy": "hybrid",
                                    "compression.warmup_steps": 3}), 8)
    assert [s for s, _ in run.phases] == [0, 3]
    assert not schedule_lib.is_compressed(run.phases[0][1])
    assert run.plan(run.phases[0][1]).describe() == "none"
    assert run.policy == policy_lib.preset("hybrid")


def test_fingerprint_is_the_model_mesh_and_last_phase():
    run = runspec.validate(_tiny(**{"compression.policy": "hybrid",
                                    "compression.error_feedback": "on"}), 8)
    fp = run.fingerprint()
    assert set(fp) == {"model", "mesh", "zero_stage", "policy", "error_feedback"}
    assert fp["model"] == dataclasses.asdict(run.model) and fp["model"]["d_model"] == 32
    assert fp["mesh"] == [2, 2, 2] and fp["zero_stage"] == 1 and fp["error_feedback"] is True
    assert fp["policy"] == policy_lib.preset("hybrid").as_dict()
    assert json.loads(json.dumps(fp)) == fp  # stored in a checkpoint's metadata as JSON
    # a warm-up changes the early steps, not the state a checkpoint holds
    warm = runspec.validate(_tiny(**{"compression.policy": "hybrid",
                                     "compression.error_feedback": "on",
                                     "compression.warmup_steps": 3}), 8)
    assert warm.fingerprint() == fp
    assert runspec.validate(_tiny(), 8).fingerprint()["policy"] != fp["policy"]


def test_step_options_are_keywords_of_the_train_step():
    run = runspec.validate(_tiny(**{"seed": 7, "train.remat": True,
                                    "compression.bucket_mib": 1.0}), 8)
    opts = run.step_options()
    assert opts == {"layout": run.zero, "microbatches": 2, "clip_norm": 1.0, "remat": True,
                    "seed": 7, "bucket_bytes": 2**20}
    assert isinstance(opts["clip_norm"], float)
    keywords = inspect.signature(step.make_train_step).parameters
    assert all(keywords[k].kind == inspect.Parameter.KEYWORD_ONLY for k in opts)


def test_optim_schedule_warms_up_to_lr_then_decays_to_its_floor():
    run = runspec.validate(_tiny(), 8)  # lr 1e-2, warmup 2, min_lr_ratio 0.1
    lr_at = run.optim.schedule(12)
    assert float(lr_at(0)) == 0.0
    assert float(lr_at(1)) == pytest.approx(0.5e-2)
    assert float(lr_at(2)) == pytest.approx(1e-2)
    assert float(lr_at(12)) == pytest.approx(1e-3)


def test_optim_tx_refuses_a_bad_setting_as_usage():
    """validate does not check b1; building the optimizer does, naming optim."""
    run = runspec.validate(_tiny(**{"optim.b1": 1.5}), 8)
    with pytest.raises(runspec.UsageError, match=r"^optim: b1 must be in \[0, 1\); got 1.5"):
        run.optim.tx(12)


# ------------------------------------------------------------------ two hops

SPLIT = {"mesh.data": 4, "mesh.pipeline": 1, "mesh.dcn_data": 2}


def test_dcn_data_splits_the_mesh_and_the_plan():
    """mesh.dcn_data=2: the mesh sizes gain a 'dcn' axis, the plans send the
    slow hop's messages (dcn.* codes them, the data entries the fast hop)."""
    run = runspec.validate(_tiny(**SPLIT, **{"compression.dcn.grad": "int4:rot"}), 8)
    assert run.dcn_data == 2 and run.mesh_shape == (4, 2, 1)
    assert run.mesh_sizes() == {"dcn": 2, "data": 2, "tensor": 2, "pipeline": 1}
    plan = run.plan(run.policy)
    assert plan.data_axes == ("dcn", "data") and run.zero.data_axes == ("dcn", "data")
    assert plan.describe() == "dcn.grad_reduce_dcn=int4:rot"
    assert run.fingerprint()["policy"]["dcn"] == {"grad": "int4:rot"}
    # an unchanged policy codes both hops with the data entries' codecs
    same = runspec.validate(_tiny(**SPLIT, **{"compression.policy": "hybrid"}), 8)
    assert same.plan(same.policy).describe().startswith(
        "data.grad_reduce=int4:rot data.param_gather=int8 dcn.grad_reduce_dcn=int4:rot "
        "dcn.param_gather_dcn=int8")
    assert runspec.validate(_tiny(), 8).dcn_data == 1


@pytest.mark.parametrize("overrides,named", [
    ({"mesh.dcn_data": 3}, ["mesh.dcn_data=3 does not divide mesh.data=2"]),
    ({"mesh.dcn_data": 0}, ["mesh.dcn_data=0; allowed: a divisor of mesh.data=2, 1 or 2"]),
    ({"mesh.dcn_data": -1}, ["mesh.dcn_data=-1; allowed: a divisor of mesh.data=2, 1 or 2"]),
    ({"mesh.dcn_data": True}, ["mesh.dcn_data=True; allowed: a divisor of mesh.data=2"]),
    ({"compression.dcn.grad": "int4"},
     ["compression.dcn.grad='int4'", "needs mesh.dcn_data > 1"]),
    ({**SPLIT, "compression.dcn.param": "powersgd:rank=2"},
     ["compression.dcn.param", "data.grad"]),
    ({**SPLIT, "compression.dcn.grad": "int3"}, ["compression.dcn.grad", "int3"]),
    ({**SPLIT, "compression.data.grad": "powersgd:rank=2"},
     ["compression.data.grad=powersgd", "mesh.dcn_data > 1"]),
    ({**SPLIT, "compression.data.grad": "int8", "compression.dcn.grad": "int4",
      "compression.error_feedback": "on"}, ["compression.dcn.grad", "both hops lossy"]),
])
def test_bad_two_hop_settings_are_refused_by_name(overrides, named):
    _assert_refused(overrides, named)


def test_dcn_data_of_a_huge_data_axis_is_checked_at_once():
    """The divisors are listed only for a refusal, found up to the square root,
    and a long list is cut."""
    import signal
    import time

    def too_slow(signum, frame):
        raise TimeoutError("mesh.dcn_data's check took over 5 s")
    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(5)
    try:
        t0 = time.perf_counter()
        sections.check_dcn_data(2, 10 ** 15)
        with pytest.raises(runspec.UsageError) as e:
            sections.check_dcn_data(7, 2 ** 40)
        took = time.perf_counter() - t0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert took < 2.0, took
    want = ("mesh.dcn_data=7 does not divide mesh.data=1099511627776; allowed: a divisor of "
            "mesh.data=1099511627776, 1, 2, 4, 8, 16, 32, 64, 128, ... or 1099511627776 "
            "(41 in all)")
    assert str(e.value).startswith(want), str(e.value)


def test_error_feedback_on_the_slow_hop_alone_is_accepted():
    run = runspec.validate(_tiny(**SPLIT, **{"compression.dcn.grad": "int4",
                                             "compression.error_feedback": "on"}), 8)
    assert run.zero.error_feedback


def test_multinode_config_codes_the_slow_hop_only_and_the_hybrid_elsewhere():
    from configs import multinode
    run = runspec.validate(multinode.get_config(), 8)
    assert run.mesh_sizes() == {"dcn": 2, "data": 2, "tensor": 2, "pipeline": 1}
    pol = run.policy
    assert (str(pol["data", "grad"]), str(pol["data", "param"])) == ("none", "none")
    assert (str(pol["dcn", "grad"]), str(pol["dcn", "param"])) == ("int4:rot", "int8")
    for entry, codec in policy_lib.HYBRID.items():
        if not entry.startswith("data."):
            assert str(pol[tuple(entry.split("."))]) == codec, entry
