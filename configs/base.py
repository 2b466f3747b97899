"""Defaults every config starts from: a small GPT on the King James Bible,
byte-level tokens, a (2, 2, 2) data x tensor x pipeline mesh, no compression.

    python train.py --config=configs/base.py --config.train.steps=100
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict(dict(
        vocab_size=256, d_model=128, n_heads=4, n_layers=4, d_ff=512, max_seq_len=128,
        tie_embeddings=True, dtype="float32"))

    # Sizes per axis; one may be -1 ("the rest of the devices"). dcn_data=k > 1 splits
    # the data axis into k slow-hop groups (nodes, slices, processes) of data/k
    # devices each: the mesh becomes ('dcn', 'data', 'tensor', 'pipeline') and the
    # compression.dcn entries code what crosses between groups (jcomp/gpt/mesh.py).
    c.mesh = ml_collections.ConfigDict(dict(data=2, tensor=2, pipeline=2, dcn_data=1))

    c.data = ml_collections.ConfigDict(dict(
        source="kjv",          # "kjv", a text file / directory / glob, or "tokens:TRAIN[,VAL]"
        tokenizer="bytes",     # "bytes" or "bpe:N" (needs `pip install 'jcomp[bpe]'`)
        token_dtype="",        # for token files: "uint16" or "uint32"
        val_permille=50,       # documents whose sha1 mod 1000 falls below go to validation
        seq_len=128,
        eval_batches=4))

    c.train = ml_collections.ConfigDict(dict(
        steps=200, batch_size=16, microbatches=2, remat=False,
        log_every=10, eval_every=50,
        nonfinite="skip",      # "skip": drop the update and count it; "stop": exit 1
        nonfinite_limit=5,     # "skip" stops (exit 1) at this many skipped updates in a row
        ef_reset_norm=0.0,     # >0: reset error-feedback residuals whose norm passes it
        profile_steps=""))     # "A-B": a jax.profiler trace of steps A..B in WORKDIR/profile/

    # name: "adamw", or "sgd" (momentum b1; b2 and eps unused) for comparisons.
    c.optim = ml_collections.ConfigDict(dict(
        name="adamw", lr=3e-3, warmup_steps=20, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8,
        weight_decay=0.1, clip_norm=1.0, zero_stage=1))

    # A preset, then per-(axis, kind) codec overrides ("" keeps the preset's).
    c.compression = ml_collections.ConfigDict(dict(
        policy="baseline",
        error_feedback="auto",  # "auto" (the preset's), "on", "off"
        warmup_steps=0,         # "@N" on every entry without a schedule below
        # The optimizer sends gradients and parameters in flat buffers of at most
        # this many MiB (jcomp.collectives.buckets: why 32).
        bucket_mib=32.0,
        # "on": choose every entry below from measured links (jcomp.train.auto.decide,
        # docs/trainer.md "Letting jcomp choose"); entries set by hand are refused.
        # "reprobe": decide afresh on a resume instead of keeping the checkpoint's.
        auto="off",
        profile="",             # with auto: a profile JSON (jcomp.tune); "" probes the mesh at start
        budget="",              # with auto: the most compressed codec per kind, "grad=int8,act=none";
                                # "outer=10" also lets it choose an outer loop syncing every 10 steps
        overlap=0.0,            # with auto: the share of link time hidden behind compute, [0, 1]
        compute_s=0.0,          # with auto: a step's compute seconds, to predict step time (0: unknown)
        trial=0))               # with auto: time this many steps of each close candidate and
                                # take the fastest (0: the model alone decides)
    # Per-(axis, kind) schedule: "CODEC@STEP,..." with increasing steps, uncompressed
    # before the first; a bare "@STEP" starts the policy's codec ("" = from step 0).
    # E.g. schedule.data.grad="bf16@0,int8@200,int4@1000". See jcomp/gpt/schedule.py.
    c.compression.schedule = ml_collections.ConfigDict()
    # One field per message the step sends (jcomp.gpt.policy.MESSAGES).
    for axis, kinds in (("data", ("grad", "param")), ("tensor", ("grad", "act", "act_grad")),
                        ("pipeline", ("act", "act_grad"))):
        c.compression[axis] = ml_collections.ConfigDict({k: "" for k in kinds})
        c.compression.schedule[axis] = ml_collections.ConfigDict({k: "" for k in kinds})
    # The slow hop (mesh.dcn_data > 1): "" = the data entry's codec. With a split, the
    # data entries code the fast hop inside a group and these the hop between groups.
    # No schedule of their own: each starts with its data entry's (jcomp/gpt/schedule.py).
    c.compression.dcn = ml_collections.ConfigDict(dict(grad="", param=""))
    # Where to compress ("" = everywhere): global layer indices for the blocks'
    # tensor-parallel all-reduces, pipeline stages for what a stage sends.
    # E.g. layers.tensor.act="4-7" (later layers only), stages.pipeline.act="0".
    c.compression.layers = ml_collections.ConfigDict(
        dict(tensor=ml_collections.ConfigDict(dict(act="", act_grad=""))))
    c.compression.stages = ml_collections.ConfigDict(
        dict(pipeline=ml_collections.ConfigDict(dict(act="", act_grad=""))))

    # The outer loop of low-communication training (DiLoCo): islands (the slow-hop
    # groups of mesh.dcn_data, else every data rank) train alone for `every` steps
    # (0: off, every step syncs as usual), then average their pseudo-gradients coded
    # with `codec` ("none", "int4:rot", "topk:0.03", ...; error feedback "on"/"off"),
    # and SGD with Nesterov momentum (lr, momentum; 0: none) moves the anchor. lr 1
    # without momentum steps to the islands' mean: on this model at every=10 it ends
    # 600 steps at +2.5% of the every-step run's val_loss, DiLoCo's (0.7, 0.9) at
    # +17% (experiments/convergence.py --suite outer, seed 0; +3.1% over 3 seeds).
    # fragments=F > 1 (Streaming DiLoCo): F groups of leaves sync in turn, every/F
    # steps apart. delay=tau > 0 (Streaming DiLoCo's overlap): a sync's result is
    # merged tau steps after it started, the islands' own share `mix` (0.5 as the
    # paper). See jcomp/train/outer/islands.py and docs/trainer.md.
    c.outer = ml_collections.ConfigDict(dict(every=0, codec="none", error_feedback="off",
                                             lr=1.0, momentum=0.0, fragments=1, delay=0,
                                             mix=0.5))

    c.checkpoint = ml_collections.ConfigDict(dict(every=50, keep=3))
    return c
