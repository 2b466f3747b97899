"""tools/regression.py: kept results are reused only for the same code on
the same machine, and a comparison flags what differs."""
import json
import pathlib

from tools import regression as reg

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_kept_results_are_reused_only_on_the_machine_that_made_them(tmp_path, monkeypatch):
    """The same code rounds differently in its last bits under another CPU or
    jaxlib, so a result kept on one machine must not stand for a run on another."""
    monkeypatch.setattr(reg, "_code_id", lambda root: ("c0de", True))
    here = {"jax": "1", "jaxlib": "1", "numpy": "1", "machine": "x86_64", "cpu": "A",
            "cpu_flags": "avx2"}
    monkeypatch.setattr(reg, "machine", lambda: here)
    kept = tmp_path / "steps5" / f"c0de-{reg.machine_id(here)}"
    kept.mkdir(parents=True)
    result = {"rc": 0, "losses": {"1": 5.5}, "bytes": {"wire_bytes_total": 10}}
    (kept / "baseline-8x1x1.json").write_text(json.dumps(result))

    got = reg.side("before", str(ROOT), str(tmp_path), 5, ("baseline",), run=False)
    assert got == {"baseline-8x1x1": result}
    assert json.loads((kept / "machine.json").read_text()) == here

    here = dict(here, cpu_flags="avx2 avx512f")  # another CPU: nothing kept applies
    assert reg.side("before", str(ROOT), str(tmp_path), 5, ("baseline",), run=False) == {}
    here = dict(here, cpu_flags="avx2", jaxlib="2")  # another jaxlib: the same
    assert reg.side("before", str(ROOT), str(tmp_path), 5, ("baseline",), run=False) == {}


def test_compare_flags_bytes_losses_and_refusals():
    ok = {"rc": 0, "losses": {"1": 5.0, "2": 4.0}, "bytes": {"wire_bytes_data": 8}}
    rows = reg.compare(
        {"same": ok, "loss": ok, "bytes": ok, "refused": ok, "only_before": ok},
        {"same": dict(ok), "loss": dict(ok, losses={"1": 5.0, "2": 4.0 * (1 + 1e-5)}),
         "bytes": dict(ok, bytes={"wire_bytes_data": 9}), "refused": {"rc": 2, "error": "x"}})
    assert set(rows) == {"same", "loss", "bytes", "refused"}
    assert rows["same"]["problems"] == [] and rows["same"]["bitwise"]
    assert "losses differ" in rows["loss"]["problems"][0] and not rows["loss"]["bitwise"]
    assert "bytes differ" in rows["bytes"]["problems"][0]
    assert "rc before 0, after 2" in rows["refused"]["problems"][0]
