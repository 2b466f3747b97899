"""jcomp: 3-D parallel (data x tensor x pipeline) LLM training whose collectives
compress what they send.

Layers, top to bottom; a module imports its own layer or below, never above
(tests/test_layout.py reads the imports and checks it):

  the run         trainer (the loop) and what it drives: runspec (the checked
                  config), resume, stepcache, steprecord, hooks, data, sources,
                  checkpoint, checksums, quiet, faults, metrics
  mesh, policy    the device mesh; the codec per (axis, kind of message); schedules
  message plan    messages: what the policy means for one model on one mesh
  model and step  model (Flax GPT), autoencoder (a learned model codec),
                  parallel (3-D layout), optimizer (ZeRO), powersgd, step
  collectives     compressed drop-ins for the jax.lax collectives
  codecs          what travels: byte codecs and the structured codecs' specs
  meter           wire and hlo: bytes read from compiled programs

Shape letters, used as suffixes (x_BxLxD) everywhere:

  B  batch rows              b  rows of one microbatch   M  microbatches
  L  sequence length         D  d_model                  V  vocabulary
  H  heads                   K  head_dim                 F  MLP hidden units
  N  layers                  A  an autoencoder's code width
  Vt a tensor rank's vocabulary shard
  d, t, p  the sizes of the data, tensor and pipeline axes
  G  devices along a collective's axes; R rows, C or M elements per row
  NB blocks per row, BL block length, PR a padded row (a block quantizer's;
  jcomp.codecs.blockwise adds its packing's letters)
  S  a parameter block's flat length, c its ZeRO shard per data rank

Partition specs name mesh axes ('data', 'tensor', 'pipeline'); parameters
name logical axes (jcomp.model.PARAM_AXES), which jcomp.parallel.AXIS_RULES
maps to mesh axes.
"""
