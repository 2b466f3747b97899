"""`jcomp.wire`, kept for existing imports: the module is `jcomp.meter.wire`."""
import sys

from jcomp.meter import wire as _module

sys.modules[__name__] = _module
