"""Codecs chosen from measured links: `compression="auto"`'s library part.

    from jcomp import tune
    prof = tune.probe(mesh)                     # links per mesh axis, codec costs
    tune.save(prof, "profile.json"); prof = tune.load("profile.json")
    d = tune.choose(prof, {("data", "grad"): (64e6, 1)}, budget={"grad": "int8"})
    cc.psum(g, "data", codec=d.codec_dict("grad"))

`profile` holds the figures (a `Link` per mesh axis, a `CodecCost` per codec),
`probe` measures them on the mesh at hand, `traffic` says what a message kind
sends per step (by hand, `messages_from` a wire report, or `messages_from_grads`
for a jax.jit step's gradient reduction), and `choose` picks
per (axis, kind) the codec of least predicted time within a ladder of allowed
codecs. Imports only jax, numpy, jcomp.codecs, jcomp.meter and
jcomp.collectives.
"""
from jcomp.tune.choose import (  # noqa: F401
    DEFAULT_LADDERS, Choice, Decision, choose, ladders, predict)
from jcomp.tune.probe import DEFAULT_CODECS, agree, fit_link, probe  # noqa: F401
from jcomp.tune.profile import CodecCost, Link, Profile, load, save  # noqa: F401
from jcomp.tune.traffic import Traffic, messages_from, messages_from_grads  # noqa: F401

__all__ = ["probe", "choose", "Profile", "Link", "CodecCost", "load", "save", "Traffic",
           "messages_from", "messages_from_grads", "Decision", "Choice", "DEFAULT_LADDERS",
           "ladders", "predict", "fit_link", "DEFAULT_CODECS", "agree"]
