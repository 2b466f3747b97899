"""jcomp: 3-D parallel (data x tensor x pipeline) LLM training whose collectives
compress what they send.

Folders, top to bottom; a module imports from its own folder or one below,
never above (tests/test_layout.py reads the imports and checks it):

  train        the run: loop and plan at its door; settings (the config read
               once into frozen values), run (checkpoints, data, metrics,
               faults, processes), outer (the outer loop), state (resume,
               compiled steps), auto (compression.auto)    [train] extra
  gpt          mesh, model (Flax GPT), autoencoder (a learned codec), policy
               (codec per axis and message kind), schedule, messages (the
               plan), parallel (3-D layout), zero (ZeRO), step
  tune         codecs chosen from measured links: profile, probe, choose
  collectives  compressed drop-ins for the jax.lax collectives and their
               kernels, PowerSGD; jit/ (cc.value_and_grad for jax.jit
               programs, which checks its bytes with the meter); outer/
               (cc.outer_sync, SparseLoCo)
  meter        wire and hlo: bytes read from compiled programs; scope: the
               named scopes the collectives write and the meter reads
  codecs       what travels: byte codecs and the structured codecs' specs

The library (codecs, collectives, meter, tune) needs only jax and numpy.

Shape letters, used as suffixes (x_BxLxD) everywhere:

  B  batch rows              b  rows of one microbatch   M  microbatches
  L  sequence length         D  d_model                  V  vocabulary
  H  heads                   K  head_dim                 F  MLP hidden units
  N  layers                  A  an autoencoder's code width
  Vt a tensor rank's vocabulary shard
  d, t, p  the sizes of the data, tensor and pipeline axes
  G  devices along a collective's axes; R rows, C elements per row
  NB blocks per row, BL block length, PR a padded row (a block quantizer's;
  jcomp.codecs.blockwise adds its packing's letters)
  S  a parameter block's flat length, c its ZeRO shard per data rank

Partition specs name mesh axes ('data', 'tensor', 'pipeline'); parameters
name logical axes (jcomp.gpt.model.PARAM_AXES), which jcomp.gpt.sharding.AXIS_RULES
maps to mesh axes.
"""
