"""Named scopes the collectives write into a program, and jcomp.meter.wire reads
back from the compiled program's op_name metadata.

  RAW_SCOPE      a compressed op that sends its operand uncompressed, because
                 its codec cannot send fewer bytes at this size, runs under
                 `jcomp_raw(CODEC)`; the meter reports every such send.
  MESSAGE_SCOPE  a program that sends named messages (the trainer's plan,
                 jcomp.gpt.messages) runs each under
                 `jcomp_msg(FORWARD,BACKWARD)`: the message its collectives send
                 forward and the one their transposes send backward (either
                 may be empty). The meter attributes bytes to them.
"""
from __future__ import annotations

import jax

RAW_SCOPE = "jcomp_raw({})"
MESSAGE_SCOPE = "jcomp_msg({},{})"


def message_scope(forward: str = "", backward: str = ""):
    """A named scope that attributes the collectives inside it (forward) and their
    transposes (backward) to these messages in a WireReport (`Collective.message`)."""
    return jax.named_scope(MESSAGE_SCOPE.format(forward, backward))
