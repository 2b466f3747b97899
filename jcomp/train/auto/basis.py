"""What a compression.auto decision rests on, and that every process rests on
the same: the newest checkpoint's decision (`saved`), the profile file
(`load_profile`), both compared across the processes of a cluster before use
(`basis`); and a re-decided policy held against the checkpoint's
(`check_reprobe`).
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os

import jax
import numpy as np

from jcomp import tune
from jcomp.train.auto.pick import overrides
from jcomp.train.run import faults

UsageError = faults.UsageError


def load_profile(path, field: str = "compression.profile") -> tune.Profile:
    try:
        return tune.load(path)
    except OSError as e:
        raise UsageError(f"{field}={path!r}: {e.strerror or e}") from None
    except (TypeError, ValueError) as e:
        raise UsageError(f"{field}={path!r}: {str(e).splitlines()[0]}") from None


def saved(workdir) -> tuple[int, dict] | None:
    """(step, decision) recorded by the newest complete checkpoint in `workdir`, or
    None. Read-only: the decision is needed before the workdir is locked, so that
    a config the decision makes invalid leaves the workdir as it was."""
    from jcomp.train.run import checkpoint
    steps = []
    for path in glob.glob(os.path.join(workdir, "checkpoints", "*", checkpoint.COMMIT_MARKER)):
        name = os.path.basename(os.path.dirname(path))
        if name.isdigit():
            steps.append(int(name))
    for step in sorted(steps, reverse=True):
        # Orbax's JsonSave item "meta" (jcomp.train.run.checkpoint) is this one file.
        try:
            with open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue  # damaged: the restore sets it aside and tries older steps too
        auto = meta.get("auto") if isinstance(meta, dict) else None
        return (step, auto) if isinstance(auto, dict) else None
    return None


def basis(s, workdir) -> tuple[tuple[int, dict] | None, dict]:
    """(the newest checkpoint's (step, decision), or None; `s` with its profile
    read where the decision is made afresh from a file), the same on every
    process of a cluster or UsageError on every one (`_agree_on_basis`). A
    resume keeping its decision (compression.auto='on') reads no profile."""
    kept = saved(workdir)
    profile, error = s.profile, None
    if profile is None and s.profile_path and not (kept is not None and s.mode == "on"):
        try:
            profile = load_profile(s.profile_path)
        except UsageError as e:
            error = e
    _agree_on_basis(s.profile_path, kept, profile, error)
    if error is not None:
        raise error
    return kept, dataclasses.replace(s, profile=profile)


def _digest(value) -> list[int]:
    text = json.dumps(value, sort_keys=True, allow_nan=True, default=str)
    return list(hashlib.sha256(text.encode()).digest()[:16])


def _agree_on_basis(path: str, kept, profile: tune.Profile | None, error) -> None:
    """In a cluster: each process's kept decision and profile figures (or its
    failure to read the file) against process 0's. Where any differs, every
    process raises a UsageError (a process that failed names its own reason),
    after the others have said they are leaving (cluster.leave_together)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    from jcomp.train.run import cluster
    mine = np.asarray([int(error is not None), kept[0] if kept else -1,
                       *_digest(kept[1] if kept else None),
                       *_digest(profile.to_dict() if profile else None)], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine))
    failed = [i for i in range(len(every)) if every[i, 0]]
    steps = [int(v) for v in every[:, 1]]
    decisions = [i for i in range(1, len(every)) if not np.array_equal(every[i, 1:18],
                                                                        every[0, 1:18])]
    figures = [i for i in range(1, len(every)) if not np.array_equal(every[i, 18:],
                                                                      every[0, 18:])]
    if not (failed or decisions or figures):
        return
    cluster.leave_together()
    if error is not None:
        raise error
    field = f"compression.profile={path!r}"
    if failed:
        raise UsageError(f"{field} could not be read on process {', '.join(map(str, failed))} "
                         "(its own line says why); every process must read the same profile")
    if decisions:
        i = decisions[0]
        held = lambda j: (f"the checkpoint of step {steps[j]}" if steps[j] >= 0
                          else "no checkpoint")
        raise UsageError(
            f"the processes would resume different compression.auto decisions: process 0 "
            f"from {held(0)}, process {i} from {held(i)}"
            + (" (another decision at the same step)" if steps[i] == steps[0] else "")
            + "; every process must see the same --workdir checkpoints")
    raise UsageError(f"{field} holds other figures on process "
                     f"{', '.join(map(str, figures))} than on process 0: every process must "
                     "plan with the same profile, or each would choose its own codecs and "
                     "compile another step; copy process 0's file to the others")


def check_reprobe(kept, summary):
    """`kept`: `saved(workdir)`, (step, decision) or None."""
    if kept is None:
        return
    step, old = kept
    was, now = overrides(old), overrides(summary)
    changed = [f"{k}={now[k]} (checkpoint: {was.get(k)})" for k in now if was.get(k) != now[k]]
    if (old.get("outer") or {}).get("every") != (summary.get("outer") or {}).get("every"):
        changed.append(f"outer.every={(summary.get('outer') or {}).get('every', 0)} "
                       f"(checkpoint: {(old.get('outer') or {}).get('every', 0)})")
    if old.get("dcn_data", 1) != summary.get("dcn_data", 1):
        changed.append(f"mesh.dcn_data={summary.get('dcn_data', 1)} (checkpoint: "
                       f"{old.get('dcn_data', 1)})")
    if changed:
        raise UsageError(f"compression.auto='reprobe' chose {', '.join(changed)}, but the "
                         f"checkpoint of step {step} is laid out for its own choice; resume "
                         "with compression.auto='on' to keep it, or train the new choice in "
                         "another --workdir")
