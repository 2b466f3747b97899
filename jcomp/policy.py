"""`jcomp.policy`, kept for existing imports: the module is `jcomp.gpt.policy`."""
import sys

from jcomp.gpt import policy as _module

sys.modules[__name__] = _module
