"""What experiments/network.py makes of its runs: a row's figures from one run's
raw measurements, and the time to the baseline's loss over the rows.

summarize() turns launch()'s records and link counters into a row (median step
time, the kernel's bytes per steady-state step against jcomp.meter.wire's, TCP
payload and retransmissions, losses, an outer loop's syncs, compression.auto's
decision); time_to_target() finds, at one rate, each policy's training time
to the baseline's final val_loss. See network.py's module doc for what each
figure measures; the report_*.py modules write RESULTS.md's sections on the
rows.
"""
from __future__ import annotations

import statistics

from experiments.network_launch import POLICIES
from jcomp.train.auto import table as auto_table


def summarize(raw: dict, warm_steps: int) -> dict:
    """A row's figures from launch()'s measurements (see the module doc)."""
    by_step, auto = {}, None
    for r in raw["records"]:
        if "step" not in r:
            auto = r.get("auto", auto)  # compression.auto's decision, logged first
            continue
        by_step[r["step"]] = {**by_step.get(r["step"], {}), **r}
    steps = sorted(by_step)
    last = steps[-1]
    static = next(r for r in raw["records"] if "wire_bytes_total" in r)
    devices = int(static["devices"])
    marks = raw["marks"]
    evals = {s for s in steps if "val_loss" in by_step[s]}
    window = [s for s in steps if s > warm_steps and s not in evals and s - 1 in marks]
    deltas = [marks[s][0][0] - marks[s - 1][0][0] for s in window]
    packets = [marks[s][0][1] - marks[s - 1][0][1] for s in window]
    retrans = [marks[s][0][2] - marks[s - 1][0][2] for s in window]
    times = [by_step[s]["step_time_s"] for s in steps if s > warm_steps]
    meter = float(static["wire_bytes_total"]) * devices
    kernel = sum(deltas) / len(deltas) if deltas else None
    per_packet = sum(packets) / len(packets) if packets else None
    # What TCP carried: the kernel's bytes less every packet's headers (the ACKs'
    # included), i.e. gloo's payload, its own framing and any retransmission.
    payload = kernel - raw["header_bytes"] * per_packet if deltas else None
    return dict(
        median_step_s=statistics.median(times), step_times_s=[by_step[s]["step_time_s"] for s in steps],
        losses=[by_step[s]["loss"] for s in steps],
        val_losses={str(s): by_step[s]["val_loss"] for s in sorted(evals)},
        # val_loss is the exact forward's since row-local blocks (train.py writes
        # val_loss_compressed beside it); rows without this mark were read
        # through a compressed forward whose blocks spanned tokens.
        exact_eval=True,
        final_loss=by_step[last]["loss"], final_val_loss=by_step[last].get("val_loss"),
        devices=devices,
        wire_bytes_per_device={k[len("wire_bytes_"):]: v for k, v in static.items()
                               if k.startswith("wire_bytes_")},
        collectives_per_step=static.get("wire_collectives"),
        meter_bytes_per_step=meter, kernel_bytes_per_step=kernel,
        # With two hops (--hops) the link carries the slow hop only: the meter's
        # 'dcn' bytes where the mesh has that axis, or an outer loop's syncs
        # averaged over H.
        meter_slow_hop_bytes_per_step=(float(static["wire_bytes_dcn"]) * devices
                                       if "wire_bytes_dcn" in static else
                                       float(static["outer_bytes_per_step"]) * devices
                                       if "outer_bytes_per_step" in static else None),
        kernel_over_meter=kernel / meter if kernel is not None and meter else None,
        kernel_bytes_by_step=dict(zip(map(str, window), deltas)),
        kernel_packets_per_step=per_packet, header_bytes_per_packet=raw["header_bytes"],
        tcp_payload_per_step=payload,
        payload_over_meter=payload / meter if payload is not None and meter else None,
        retransmitted_segments_per_step=sum(retrans) / len(retrans) if retrans else None,
        kernel_window_steps=window,
        startup_bytes=marks[steps[0]][0][0] - raw["before"][0] if steps[0] in marks else None,
        after_last_step_bytes=raw["after"][0] - marks[last][0][0] if last in marks else None,
        wall_s=raw["wall_s"], first_step_at_s=marks[steps[0]][1] if steps[0] in marks else None,
        **_outer_figures(by_step, static, window, dict(zip(window, deltas)), devices),
        **({"auto": _auto_figures(auto)} if auto else {}))


def _auto_figures(decision: dict) -> dict:
    """What compression.auto chose for a row: per entry the codec and the link it
    priced, and the predicted communication seconds per step against raw."""
    return dict(codecs={e: v["codec"] for e, v in decision["entries"].items()},
                links={e: [v["latency_s"], v["bytes_per_s"]]
                       for e, v in decision["entries"].items()},
                dcn_data=decision.get("dcn_data", 1), outer=decision.get("outer"),
                routes={k: v["seconds"] for k, v in decision.get("routes", {}).items()},
                route_links={k: v["links"] for k, v in decision.get("routes", {}).items()},
                codec_s_per_byte={c: v["encode_s_per_byte"] + v["decode_s_per_byte"]
                                  for c, v in decision["profile"]["codecs"].items()},
                predicted_s=decision["seconds"], predicted_raw_s=decision["raw_seconds"],
                # compression.trial: each candidate's measured step, the model's
                # prediction with compute from the uncompressed trial, and the taken
                # one's trial time (the decision's predicted step).
                **({"trial": decision["trial"], "trial_step_s": decision["step_s"]}
                   if decision.get("trial") else {}),
                table=auto_table.table(decision))  # as train.py printed it


def _outer_figures(by_step, static, window, delta, devices) -> dict:
    """An outer loop's syncs (none for an every-step run): each sync's own time
    by step (with outer.delay, each merge's too; a start carried by the next
    step has none of its own, that step's time holds it, but one on a thread
    beside the step's is timed there: outer_start_s_by_step), and its
    bytes on the link (the kernel bytes of the step that sent it less the median
    step without a sync) against the meter's (outer_bytes_per_sync per device,
    read from the compiled sync program, times the devices)."""
    if "outer_bytes_per_step" not in static:
        return {}
    alone = [s for s in sorted(by_step) if "outer_sync_s" in by_step[s]]
    carried = [s for s in sorted(by_step) if "outer_carried" in by_step[s]]
    synced = sorted(alone + carried)  # the steps whose kernel bytes hold a sync
    plain = [delta[s] for s in window if s not in synced]
    rest = statistics.median(plain) if plain else None
    measured = [s for s in synced if s in delta and rest is not None]
    kernel = sum(delta[s] - rest for s in measured)
    # A carried start's meter bytes are on the record of the step it was due after.
    sender = {s: (s - 1 if s in carried else s) for s in measured}
    meter = sum(by_step[sender[s]]["outer_bytes_per_sync"] * devices for s in measured)
    applies = {str(s): r["outer_apply_s"] for s, r in sorted(by_step.items())
               if "outer_apply_s" in r}
    threaded = {str(s): by_step[s]["outer_start_s"] for s in carried
                if "outer_start_s" in by_step[s]}
    return dict(outer_sync_s_by_step={str(s): by_step[s]["outer_sync_s"] for s in alone},
                **({"outer_apply_s_by_step": applies} if applies else {}),
                **({"outer_start_s_by_step": threaded} if threaded else {}),
                **({"outer_carried_steps": carried} if carried else {}),
                kernel_bytes_per_step_without_sync=rest,
                kernel_sync_bytes=kernel if measured else None,
                meter_sync_bytes=meter if measured else None,
                kernel_over_meter_sync=kernel / meter if measured and meter else None)


def time_to_target(rows: list[dict], rate: str) -> dict | None:
    """At `rate`: the baseline's final val_loss in its sweep run and, per policy,
    the training time (sum of step times) to the first validation loss at or
    below it in that policy's time-to-loss run (the baseline's own sweep run
    where it has none); with several time-to-loss runs of the newest commit
    (--ttl-repeats), the median of their times (times_s: each run's). Each is
    the newest such row, whatever its commit: training is deterministic, so a
    loss does not depend on when it was run.
    A compressed policy's row counts only if it was evaluated exactly
    (`exact_eval`): earlier ones read the loss through a forward whose blocks
    spanned tokens, which leaked the next token."""
    ok = sorted((r for r in rows if r["settings"]["rate"] == rate and "error" not in r
                 and (r.get("exact_eval") or r["settings"]["policy"] == "baseline")),
                key=lambda r: r["date"], reverse=True)
    base = next((r for r in ok if r["settings"]["kind"] == "sweep"
                 and r["settings"]["policy"] == "baseline" and r.get("final_val_loss")), None)
    if base is None:
        return None
    target = base["final_val_loss"]
    out = {"rate": rate, "target_val_loss": target, "target_commit": base["commit"],
           "policies": {}}
    for r in sorted(ok, key=lambda r: r["settings"]["kind"] != "ttl"):  # stable: newest first
        name = r["settings"]["policy"]
        if name in out["policies"] or (r["settings"]["kind"] != "ttl" and r is not base):
            continue
        runs = [r] if r is base else [
            x for x in ok if x["settings"]["kind"] == "ttl" and x["commit"] == r["commit"]
            and {**x["settings"], "repeat": 0} == {**r["settings"], "repeat": 0}]
        every = int(POLICIES.get(name, {}).get("outer.every", 0))
        hits = [_hit(x, target, every) for x in runs]
        times = [t for _, t in hits if t is not None]
        out["policies"][name] = dict(
            kind=r["settings"]["kind"], commit=r["commit"],
            steps_run=r["settings"]["steps"], reached=hits[0][0] is not None, step=hits[0][0],
            time_s=statistics.median(times) if times else None,
            **({"times_s": times} if len(runs) > 1 else {}),
            best_val_loss=min((v for s, v in r["val_losses"].items()
                               if not (every and int(s) % every)), default=None))
    return out


def _hit(r: dict, target: float, every: int) -> tuple:
    """(the first step whose val_loss is at or below `target`, the training time
    to it), or (None, None)."""
    # Between an outer loop's syncs each island holds its own model: only a
    # synced one counts (train.eval_every a multiple of outer.every).
    hit = next((int(s) for s, v in sorted(r["val_losses"].items(), key=lambda kv: int(kv[0]))
                if v <= target and not (every and int(s) % every)), None)
    if hit is None:
        return None, None
    syncs = {**r.get("outer_sync_s_by_step", {})}
    for s, t in r.get("outer_apply_s_by_step", {}).items():  # with outer.delay
        syncs[s] = syncs.get(s, 0.0) + t
    # An outer loop's time is its inner steps' and its syncs' up to the hit.
    return hit, sum(r["step_times_s"][:hit]) + sum(t for s, t in syncs.items() if int(s) <= hit)
