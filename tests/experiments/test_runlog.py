"""experiments/runlog.py: a study's runs.jsonl stands in for its run folders, so
convergence.py's rows and plots are the same with or without them."""
import json
import math
import shutil

import pytest

from experiments import convergence as conv
from experiments import convergence_specs as conv_specs
from experiments import convergence_summary as conv_sum
from experiments import report
from experiments import runlog
from jcomp.train.run import metrics as metrics_lib

STEPS = 6


def _run_folder(study, name, seed, val, wire=100.0, restarts=None):
    """A finished run's folder as train.py and convergence.py leave it, with
    metrics no report reads beside those it does."""
    spec = next(s for s in conv_specs.run_specs() if s["name"] == name)
    wd = study / conv_specs.workdir_name(spec, STEPS, seed)
    wd.mkdir(parents=True)
    recs = [{"step": 1, "loss": 5.0, "grad_norm": 2.0, "step_time_s": 0.5, "tokens_per_s": 9.0,
             "wire_bytes_total": wire, "wire_bytes_data": wire / 2, "wire_bytes_tensor": wire / 4,
             "wire_bytes_data+tensor": 3.0, "devices": 8, "compression": "none"}]
    recs += [{"step": s, "loss": val + 1.0 / s, "grad_norm": 1.0 + s, "ef_norm": 0.25,
              "lr": 1e-3, "step_time_s": 0.1 * s} for s in range(2, STEPS + 1)]
    recs[3]["val_loss"] = val + 0.5
    recs.append(dict(recs[3], loss="NaN"))  # a resumed run repeats a step; NaN as written
    recs.append({"step": STEPS, "loss": val, "val_loss": val, "val_loss_compressed": val + 0.01})
    (wd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (wd / conv.COMMIT_FILE).write_text("abc1234\n")
    (wd / "events.out.tfevents.1.vm").write_bytes(b"\0\1")
    if restarts is not None:
        (wd / conv.RESTARTS_FILE).write_text(json.dumps(restarts))
    return wd


@pytest.fixture
def study(tmp_path):
    study = tmp_path / "study"
    for seed, base in ((0, 2.0), (1, 2.2)):
        _run_folder(study, "baseline", seed, base)
        _run_folder(study, "naive", seed, base * 1.01, wire=13.0,
                    restarts=[{"stuck_after_step": 3, "log": "stuck1.log"}] if seed else None)
    return study


def _collect(study):
    return conv_sum.collect(str(study), STEPS, lambda spec, seed=0: [], seeds=[0, 1])


def _drop_run_folders(study):
    for d in study.iterdir():
        if d.is_dir():
            shutil.rmtree(d)


def test_rows_from_runs_jsonl_equal_rows_from_the_folders(study):
    from_folders = _collect(study)
    assert [(r["name"], r["seed"]) for r in from_folders] == [
        ("baseline", 0), ("naive", 0), ("baseline", 1), ("naive", 1)]
    runlog.write(study)
    _drop_run_folders(study)
    from_summary = _collect(study)
    assert json.dumps(from_summary) == json.dumps(from_folders)  # NaN compared as NaN
    naive1 = from_summary[3]
    assert naive1["git_commit"] == "abc1234"
    assert naive1["restarts"] == [{"stuck_after_step": 3, "log": "stuck1.log"}]
    assert "restarts" not in from_summary[1]
    assert naive1["final_val_loss_compressed"] == pytest.approx(2.2 * 1.01 + 0.01)
    assert naive1["byte_ratio"] == pytest.approx(0.13)
    assert conv_sum.seeds_on_disk(str(study), STEPS) == [0, 1]


def test_runs_jsonl_keeps_the_read_fields_of_every_record(study):
    runlog.write(study)
    lines = (study / runlog.RUNS_FILE).read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    assert [e["run"] for e in entries] == sorted(e["run"] for e in entries) and len(entries) == 4
    recs = entries[0]["records"]
    assert len(recs) == STEPS + 2  # every record, the repeated step included
    assert recs[0]["wire_bytes_total"] == 100.0 and "wire_bytes_data+tensor" not in recs[0]
    assert all(set(r) <= set(runlog.FIELDS) for e in entries for r in e["records"])
    assert recs[-2]["loss"] == "NaN"  # strict JSON, as in metrics.jsonl
    assert math.isnan(runlog.read(study)[entries[0]["run"]]["records"][-2]["loss"])


def test_a_record_without_a_step_is_left_out(study):
    """compression.auto's decision, the first record of its runs, has no step: the
    summary keeps the step records only, and reads back as before."""
    run = next(d for d in study.iterdir() if d.is_dir())
    metrics = run / "metrics.jsonl"
    before = runlog.from_folder(str(run))["records"]
    metrics.write_text(json.dumps({"auto": {"seconds": 0.1}}) + "\n" + metrics.read_text())
    assert runlog.from_folder(str(run))["records"] == before
    runlog.write(study)
    assert runlog.read(study)[run.name]["records"][0]["step"] == 1


def test_plots_from_runs_jsonl_equal_plots_of_the_run_folders(study, tmp_path):
    """The same PNG, labels included, as jcomp.train.run.metrics.plot draws from the folders."""
    first = [r for r in _collect(study) if r["seed"] == 0]
    folders = metrics_lib.plot([study / f"{r['name']}-{STEPS}steps" for r in first],
                               tmp_path / "folders.png")
    runlog.write(study)
    _drop_run_folders(study)
    assert conv_sum.draw_plots(str(study), first) == {"main": "main_loss.png"}
    assert (study / "main_loss.png").read_bytes() == open(folders, "rb").read()


def test_write_keeps_runs_whose_folder_is_gone(study):
    runlog.write(study)
    gone = sorted(d for d in study.iterdir() if d.is_dir())[0]
    shutil.rmtree(gone)
    kept = sorted(d.name for d in study.iterdir() if d.is_dir())
    (study / kept[0] / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 9.0, "wire_bytes_total": 1.0}) + "\n")
    runlog.write(study)
    runs = runlog.read(study)
    assert set(runs) == {gone.name, *kept}
    assert runs[kept[0]]["records"] == [{"step": 1, "loss": 9.0, "wire_bytes_total": 1.0}]


def test_a_run_finished_in_runs_jsonl_is_not_trained_again(study, monkeypatch, capsys):
    runlog.write(study)
    _drop_run_folders(study)

    def no_training(*args, **kwargs):
        raise AssertionError("train.py started for a finished run")

    monkeypatch.setattr(conv, "run_one", no_training)
    assert conv.main(["--suite", "seeds", "--only", "baseline", "--steps", str(STEPS),
                      "--seeds", "0", "1", "--out", str(study)]) == 0
    assert "baseline-6steps: finished already, skipped" in capsys.readouterr().out
    summary = json.loads((study / "summary.json").read_text())
    assert [(r["name"], r["seed"]) for r in summary["runs"]] == [
        ("baseline", 0), ("naive", 0), ("baseline", 1), ("naive", 1)]


def test_report_summarize_writes_each_study(study, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.main(["--summarize", str(study)]) == 0
    assert (study / runlog.RUNS_FILE).exists()
    assert report.main(["--summarize", str(empty)]) == 2
    assert str(empty) in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ("{not json\n", "not valid JSON"),
    ("[1, 2]\n", "expected a JSON object"),
    ('{"run": "a", "git_commit": null}\n', "'records' must be a list"),
    ('{"run": "a", "git_commit": null, "records": [{"loss": 1.0}]}\n', "each with a 'step'"),
    ('{"run": "", "git_commit": null, "records": []}\n', "'run' must be a non-empty string"),
    ('{"run": "a", "git_commit": 7, "records": []}\n', "'git_commit' must be"),
    ('{"run": "a", "git_commit": null, "records": [], "restarts": {}}\n', "'restarts' must be"),
    ('{"run": "a", "git_commit": null, "records": []}\n' * 2, "appears twice"),
])
def test_a_malformed_runs_jsonl_is_a_value_error_naming_the_file(tmp_path, content, message):
    (tmp_path / runlog.RUNS_FILE).write_text(content)
    with pytest.raises(ValueError, match=message) as e:
        runlog.read(tmp_path)
    assert str(tmp_path / runlog.RUNS_FILE) + ":" in str(e.value)
    with pytest.raises(ValueError, match=message):
        conv_sum.collect(str(tmp_path), STEPS, lambda spec, seed=0: [])


def test_a_missing_runs_jsonl_is_a_value_error_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match="no such file") as e:
        runlog.read(tmp_path)
    assert str(tmp_path / runlog.RUNS_FILE) in str(e.value)
    with pytest.raises(ValueError, match="holds no run folder"):
        runlog.write(tmp_path)


def test_bad_study_dir_arguments(tmp_path):
    with pytest.raises(TypeError, match="study_dir must be a str or path"):
        runlog.read(3)
    with pytest.raises(ValueError, match="study_dir .* is not a directory"):
        runlog.gather(tmp_path / "nowhere")
