"""Trains a GPT over a (data, tensor, pipeline) mesh with compressed collectives.

    python train.py                                   # small default, any devices
    python train.py --config=configs/hybrid.py --workdir=runs/hybrid
    python train.py --config=configs/tiny.py --config.train.steps=50

Multi-host: every process runs the same command. On SLURM or Open MPI clusters
`--distributed` lets JAX find the coordinator; elsewhere pass
--coordinator_address, --num_processes and --process_id (or the environment
variables JCOMP_COORDINATOR, JCOMP_NUM_PROCESSES, JCOMP_PROCESS_ID).

Exit codes: 0 done (or stopped by SIGTERM / a first Ctrl-C, after saving the
step in flight, or before the first step with nothing to save), 1 stopped on
non-finite losses, 2 bad configuration, flags, input or workdir, or the workdir
in use by another trainer (one line on stderr, the workdir untouched), 3 a
write failed mid-run, e.g. disk full (one line naming the last complete
checkpoint), 4 a peer process of the cluster was lost (one line naming it and
the last complete checkpoint; the details in WORKDIR/process<i>.log), 130 a
second Ctrl-C (stopped at once, nothing saved).
"""
import difflib
import importlib.util
import os
import sys
import threading
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # configs/ import configs.base

from jcomp.train.run import cluster, faults, quiet  # noqa: E402  (no JAX: the signal handlers go in first)

_STOP = faults.StopFlag().install()

from absl import app, flags, logging  # noqa: E402
from ml_collections import ConfigDict, config_flags  # noqa: E402

EXIT_NONFINITE, EXIT_USAGE, EXIT_WRITE = 1, 2, 3
_ENV_ERRORS = []


def _env_int(name, default=None):
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        _ENV_ERRORS.append(f"environment variable {name}={raw!r} must be an integer")
        return default


_DEFAULT_CONFIG = os.path.join(_HERE, "configs", "base.py")
config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "Config file (python, get_config()).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints and metrics.jsonl go here; rerunning resumes. "
                    "Default: runs/<config file name>.")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (cluster auto-detection).")
flags.DEFINE_string("coordinator_address", os.environ.get("JCOMP_COORDINATOR"), "host:port of process 0.")
flags.DEFINE_integer("num_processes", _env_int("JCOMP_NUM_PROCESSES"), "Number of processes.")
flags.DEFINE_integer("process_id", _env_int("JCOMP_PROCESS_ID"), "This process's id.")
flags.DEFINE_integer("cpu_devices", _env_int("JCOMP_CPU_DEVICES", 8),
                     "Emulated devices per process when JAX runs on the CPU.", lower_bound=1)
flags.DEFINE_integer("peer_timeout", 120, "Seconds without a peer's heartbeat after which "
                     "JAX ends the other processes of the cluster (train.py then exits 4).",
                     lower_bound=1, upper_bound=3600)
flags.DEFINE_integer("init_timeout", 300, "Seconds a process waits for the whole cluster to "
                     "join (jax.distributed.initialize) before it gives up with one line.",
                     lower_bound=1, upper_bound=3600)
FLAGS = flags.FLAGS


def _fail(message: str, code: int = EXIT_USAGE):
    quiet.exit_with_line(f"train.py: error: {message}".replace("\n", " ") + "\n", code)


def _start_jax():
    import jax

    from jcomp.collectives import cpu
    # Before the backend starts: the CPU scheduler under which two-hop steps do
    # not stop in their collectives (jcomp/collectives/cpu.py); GPUs ignore it.
    cpu.add_flag()
    # Only the CPU backend reads this; on GPU nodes the real devices are used.
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
    if FLAGS.coordinator_address or FLAGS.distributed:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX's client ends the process from C++ when its own timeout passes, before
        # any Python except runs: this timer says it first, in one line.
        watchdog = threading.Timer(FLAGS.init_timeout, _fail, [
            f"--coordinator_address={FLAGS.coordinator_address}: the cluster of "
            f"{FLAGS.num_processes or 'the detected'} processes did not form within "
            f"--init_timeout={FLAGS.init_timeout} s"
            + ("" if FLAGS.process_id is None else f" (process {FLAGS.process_id} waited)") + "; "
            "check that every process was started, with the same address and port"])
        watchdog.daemon = True
        watchdog.start()
        try:
            jax.distributed.initialize(coordinator_address=FLAGS.coordinator_address,
                                       num_processes=FLAGS.num_processes,
                                       process_id=FLAGS.process_id,
                                       initialization_timeout=FLAGS.init_timeout + 60,
                                       heartbeat_timeout_seconds=FLAGS.peer_timeout)
        except (RuntimeError, ValueError) as e:
            watchdog.cancel()
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if FLAGS.distributed and not FLAGS.coordinator_address:
                _fail(f"--distributed: no cluster to join ({first}); JAX detects SLURM and "
                      "Open MPI jobs; elsewhere pass --coordinator_address, --num_processes "
                      "and --process_id")
            _fail(f"--coordinator_address={FLAGS.coordinator_address}: joining the cluster "
                  f"failed: {first}")
        watchdog.cancel()
    return jax


def _config_arg(argv):
    """The --config value in argv (the last one wins), or None."""
    value = None
    for i, a in enumerate(argv[1:], 1):
        if a.startswith("--config="):
            value = a.split("=", 1)[1]
        elif a == "--config" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def _config_file(argv) -> tuple[str, str, str | None]:
    """(the --config value as given, the absolute path of its file, the argument
    after its ':' for get_config, or None)."""
    value = _config_arg(argv) or _DEFAULT_CONFIG
    file, _, arg = value.partition(":")
    return value, os.path.abspath(file), arg or None


def _raised_by_config_file(e: BaseException, path: str) -> str:
    """What went wrong inside the config file, from the exception's own traceback."""
    if isinstance(e, SyntaxError) and e.filename and os.path.abspath(e.filename) == path:
        return f"{type(e).__name__} at line {e.lineno}: {e.msg}"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == path]
    if not frames:
        return f"{type(e).__name__}: {e}"
    f = frames[-1]
    raiser = f"{f.name}() raised" if f.name != "<module>" else "raised"
    return f"{raiser} {type(e).__name__}: {e} (line {f.lineno})"


def _check_config_file(argv):
    """Runs the config file's get_config() as config_flags will, so that an error
    in it is read from its own traceback, and checks that every --config.FIELD
    override names a field of what it returns."""
    value, path, arg = _config_file(argv)
    if not os.path.exists(path):
        _fail(f"--config={value}: no such file; pass a Python file defining get_config(), "
              "e.g. --config=configs/tiny.py")
    if not os.path.isfile(path):
        _fail(f"--config={value}: {path} is a directory; pass a Python file defining get_config()")
    try:
        spec = importlib.util.spec_from_file_location("_train_config_check", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cfg = module.get_config(*([arg] if arg is not None else []))
    except Exception as e:  # noqa: BLE001  (the config file's own code may raise anything)
        _fail(f"--config={value}: {_raised_by_config_file(e, path)}")
    # Refused here rather than after flag parsing: for a None, config_flags would
    # first log a two-line warning of its own.
    _check_is_config(value, cfg)
    for a in argv[1:]:
        if a.startswith("--config."):
            _check_field(cfg, a.split("=", 1)[0])


def _check_is_config(value: str, cfg):
    if not isinstance(cfg, ConfigDict):
        got = "None (a missing return statement?)" if cfg is None else type(cfg).__name__
        _fail(f"--config={value}: get_config() returned {got}, not a ConfigDict")


def _check_field(cfg, flag: str):
    """--config.a.b names a field of `cfg`, or one line naming the first part that
    does not exist, with the closest field there."""
    node = cfg
    for part in flag[len("--config."):].split("."):
        if not isinstance(node, ConfigDict) or part not in node:
            fields = list(node.keys()) if isinstance(node, ConfigDict) else []
            close = difflib.get_close_matches(part, fields, n=1)
            _fail(f"{flag}: the config has no field {part!r}"
                  + (f" (did you mean {close[0]!r}?)" if close else ""))
        node = node[part]


def _loaded_config(argv):
    value = _config_file(argv)[0]
    cfg = FLAGS.config
    try:
        cfg.get("train")  # a file that failed to load raises only when first read
    except OSError as e:
        _fail(f"--config={value}: {e.__cause__ or e}")
    except AttributeError:
        pass
    _check_is_config(value, cfg)
    return cfg


def main(argv, full_argv=None, hooks=None):
    """absl's main: `argv` what flag parsing left, `full_argv` the command line it
    parsed (default sys.argv), `hooks` a jcomp.train.run.hooks.Hooks for the loop."""
    if len(argv) > 1:
        _fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if _ENV_ERRORS:
        _fail(_ENV_ERRORS[0])
    cfg = _loaded_config(sys.argv if full_argv is None else full_argv)
    workdir = FLAGS.workdir or os.path.join(
        "runs", os.path.splitext(os.path.basename(config_flags.get_config_filename(FLAGS["config"])))[0])
    try:
        faults.check_process_flags(FLAGS.coordinator_address, FLAGS.num_processes,
                                   FLAGS.process_id, FLAGS.distributed)
        faults.check_workdir(workdir)
    except faults.UsageError as e:
        _fail(str(e))
    if (FLAGS.coordinator_address or FLAGS.distributed) and not cluster.supervised():
        cluster.supervise(sys.argv, workdir)  # this process's own command, run as its child
    logging.set_verbosity(logging.WARNING)  # before JAX's own INFO lines on joining a cluster
    jax = _start_jax()
    from jcomp.train import loop as trainer

    try:  # before anything is written: one config for the whole cluster
        cluster.agree_on_config({**cfg.to_dict(), "--cpu_devices": FLAGS.cpu_devices},
                                FLAGS.init_timeout)
    except faults.UsageError as e:
        cluster.leave_together()
        _fail(str(e))

    try:
        last = trainer.train_and_evaluate(cfg, workdir, stop=_STOP, hooks=hooks)
    except trainer.UsageError as e:
        _fail(str(e))
    except trainer.NonFiniteError as e:
        _fail(str(e), code=EXIT_NONFINITE)
    except trainer.WriteError as e:
        if jax.process_count() > 1 and cluster.is_peer_error(e):
            _peer_lost(e, workdir)  # a save's collectives saw the peer go: not the disk
        _fail(str(e), code=EXIT_WRITE)
    except Exception as e:  # noqa: BLE001  (a lost peer surfaces as the runtime's own error)
        if jax.process_count() == 1 or not cluster.is_peer_error(e):
            raise
        _peer_lost(e, workdir)
    if jax.process_index() == 0 and last:
        from jcomp.train.run import traffic
        sent = traffic.closing(last["wire_bytes_total"], last.get("uncompressed_bytes_total"),
                               last.get("uncompressed_measured", False))
        print(f"step {last['step']}: loss {last['loss']:.4f}"
              + (f", val_loss {last['val_loss']:.4f}" if "val_loss" in last else "")
              + f"; {sent}"
              + (f" (+ {traffic.human(last.get('outer_across_bytes_per_step', last['outer_bytes_per_step']))}"
                 "/step across islands, outer loop)" if "outer_bytes_per_step" in last else "")
              + f"; metrics in {os.path.join(workdir, 'metrics.jsonl')}")
    if FLAGS.coordinator_address or FLAGS.distributed:
        jax.distributed.shutdown()


def _peer_lost(e, workdir):
    """A collective saw a peer go. JAX's coordination service names it once its
    heartbeats stop (--peer_timeout) and ends this process; the supervisor then
    says which process was lost. Should that not come, say it here."""
    traceback.print_exc(file=sys.__stderr__)  # into the process log
    time.sleep(FLAGS.peer_timeout + 30)
    _fail(f"a peer process of the cluster was lost ({str(e).strip().splitlines()[0]}); "
          f"the last complete checkpoint is step {cluster.last_complete_step(workdir)}; "
          "rerun every process with the same command to resume from it",
          code=cluster.PEER_LOST_EXIT)


def _parse_flags(argv):
    # Errors in the config file and overrides of fields that do not exist are
    # found first (_check_config_file); a value of the wrong type raises from
    # inside flag parsing, before main: one line and exit 2.
    _check_config_file(argv)
    try:
        return FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
        _fail(str(e.args[0] if isinstance(e, KeyError) and e.args else e))


def run(argv=None, hooks=None):
    """The command: parses `argv` (default sys.argv; argv[0] the program) and
    trains, calling `hooks` (a jcomp.train.run.hooks.Hooks) at the loop's defined points."""
    argv = list(sys.argv if argv is None else argv)
    app.run(lambda rest: main(rest, argv, hooks), argv=argv, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
