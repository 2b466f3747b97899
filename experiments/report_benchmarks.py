"""RESULTS.md's sections on the benchmarks (benchmarks/results/): compressed
collectives against jax.lax (collectives.json, collectives_sizes.json), the
3-D parallel train step (parallel.json) and the GPU figures (gpu.json);
report.py calls these."""
from __future__ import annotations

from experiments.report_format import fmt, table
from experiments.report_network import _f, _table
from jcomp.train.run.metrics import human_bytes


def collectives_section(col: dict) -> str:
    size = max(r["elements"] for r in col["rows"])
    rows = [[r["op"], r["axis"], r["codec"], human_bytes(r["bytes_per_device"]),
             fmt(r["byte_ratio"], ".3f"), fmt(r["rel_err"], ".2e"), fmt(r["time_ratio"], ".2f")]
            for r in col["rows"] if r["elements"] == size]
    head = (f"{col['device_count']} {col['backend']} devices, mesh {col['mesh']}, "
            f"{size} float32 elements per device, median of {col['repeats']} calls; date "
            f"{col['date']}.")
    out = head + "\n\n" + table(["op", "axis", "codec", "bytes/device", "bytes vs lax",
                                 "rel. error", "time vs lax"], rows)
    structured = [r for r in col.get("structured_rows", [])
                  if r["matrix"][0] * r["matrix"][1] == size]
    if structured:
        out += ("\n\nStructured codecs beside the jax.lax op they replace, on [m, n] matrices: "
                "PowerSGD (one call from a random Q, no warm start) on a rank-4 matrix shared by "
                "the devices plus 10% noise of each device's own; the autoencoder untrained (a "
                "random orthonormal projection to n/4, so its error is not a trained one's).\n\n"
                + table(["codec", "axis", "vs", "matrix", "bytes/device", "bytes vs lax",
                         "rel. error", "time vs lax"],
                        [[r["codec"], r["axis"], r["reference"],
                          f"{r['matrix'][0]}x{r['matrix'][1]}", human_bytes(r["bytes_per_device"]),
                          fmt(r["byte_ratio"], ".3f"), fmt(r["rel_err"], ".2e"),
                          fmt(r["time_ratio"], ".2f")] for r in structured]))
    return out


def sizes_section(sz: dict) -> str:
    """Bytes vs jax.lax per op, codec and axis size, one column per size."""
    sizes = sorted({r["elements"] for r in sz["rows"]})
    keys = list(dict.fromkeys((r["op"], r["codec"], r["n"]) for r in sz["rows"]))
    by = {(r["op"], r["codec"], r["n"], r["elements"]): r for r in sz["rows"]}
    cell = lambda r: "-" if r is None or r["ratio"] is None else (
        "raw" if r["raw"] else fmt(r["ratio"], ".3f"))
    rows = [[op, codec, n] + [cell(by.get((op, codec, n, e))) for e in sizes]
            for op, codec, n in keys]
    head = (f"{sz['backend']} backend, jax {sz['jax_version']}, commit {sz['commit']}, date "
            f"{sz['date']}. Bytes one device sends per call relative to the jax.lax op, read "
            "from each compiled program; raw = sent uncompressed (exactly lax's bytes). "
            + ("Checks: pass." if not sz["violations"] else
               "Checks failed: " + "; ".join(sz["violations"])))
    return head + "\n\n" + table(["op", "codec", "n"] + [str(e) for e in sizes], rows)


def parallel_section(par: dict) -> str:
    rows = [[",".join(map(str, r["shape"])), r["policy"], r["microbatches"], fmt(r["time_s"], ".3f"),
             fmt(r.get("time_ratio"), ".2f"), human_bytes(r["wire_bytes_total"]),
             fmt(r.get("wire_ratio"), ".3f"), fmt(r["predicted_bubble"], ".2f"),
             fmt(r.get("measured_bubble"), ".2f")] for r in par["rows"]]
    head = f"{par['device_count']} {par['backend']} devices; model {par['model']}; date {par['date']}."
    return head + "\n\n" + table(["mesh d,t,p", "policy", "M", "step s", "time vs baseline",
                                  "bytes/step", "bytes vs baseline", "bubble pred.",
                                  "bubble meas."], rows)


def gpu_section(gpu: dict | None) -> str:
    if not gpu or gpu.get("backend") != "gpu":
        return ("No GPU was available when these results were made, so there are no GPU "
                "figures. `benchmarks/gpu.py` is ready for one: `pip install -e '.[cuda12]' && "
                "python -m benchmarks.gpu` measures codec encode/decode GB/s at 1-256 MiB, each "
                "cc.* op against its jax.lax twin, and train.py's step time per policy "
                "(`--tiny` is its CPU form, run by tests/benchmarks/test_gpu.py).")
    head = (f"`{gpu['command']}` on {gpu['device_count']} x {gpu['device_kind']}, JAX "
            f"{gpu['jax_version']}, {gpu['date']}; medians of {gpu['repeats']} calls.")
    codecs = _table(["codec", "MiB", "encode GB/s", "decode GB/s", "rel. error"],
                    [[r["codec"], f"{r['mib']:g}", _f(r["encode_gb_s"], ".1f"),
                      _f(r["decode_gb_s"], ".1f"), _f(r["rel_err"], ".2e")] for r in gpu["codecs"]])
    col = gpu["collectives"]
    ops = _table(["op", "axis size", "codec", "ms", "time vs lax", "bytes vs lax"],
                 [[r["op"], r["axis_size"], r["codec"], _f(r["time_s"] * 1e3, ".3f"),
                   _f(r["time_ratio"], ".2f"), _f(r["byte_ratio"], ".3f")] for r in col["rows"]])
    train = _table(["policy", "devices", "median step ms", "tokens/s"],
                   [[r["policy"], r.get("devices", "-"),
                     _f(r.get("median_step_s") and r["median_step_s"] * 1e3, ".1f"),
                     _f(r.get("tokens_per_s"), ".0f")] for r in gpu["train"]])
    return "\n\n".join([head, codecs, f"Mesh {col['mesh']}, {col['elements_per_device']} "
                        "float32 elements per device:", ops, train])
