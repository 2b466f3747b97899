"""Trains a GPT over a (data, tensor, pipeline) mesh with compressed collectives.

    python train.py                                   # small default, any devices
    python train.py --config=configs/hybrid.py --workdir=runs/hybrid
    python train.py --config=configs/tiny.py --config.train.steps=50

Multi-host: every process runs the same command. On SLURM or Open MPI clusters
`--distributed` lets JAX find the coordinator; elsewhere pass
--coordinator_address, --num_processes and --process_id (or the environment
variables JCOMP_COORDINATOR, JCOMP_NUM_PROCESSES, JCOMP_PROCESS_ID).

Exit codes: 0 done (or stopped by SIGTERM/SIGINT after saving), 1 stopped on a
non-finite loss, 2 bad configuration or input (one line on stderr).
"""
import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # configs/ import configs.base

config_flags.DEFINE_config_file("config", os.path.join(_HERE, "configs", "base.py"),
                                "Config file (python, get_config()).", lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints and metrics.jsonl go here; rerunning resumes. "
                    "Default: runs/<config file name>.")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (cluster auto-detection).")
flags.DEFINE_string("coordinator_address", os.environ.get("JCOMP_COORDINATOR"), "host:port of process 0.")
flags.DEFINE_integer("num_processes", int(os.environ.get("JCOMP_NUM_PROCESSES", 0)) or None,
                     "Number of processes.")
flags.DEFINE_integer("process_id", int(os.environ.get("JCOMP_PROCESS_ID", -1)) if
                     os.environ.get("JCOMP_PROCESS_ID") else None, "This process's id.")
flags.DEFINE_integer("cpu_devices", int(os.environ.get("JCOMP_CPU_DEVICES", 8)),
                     "Emulated devices per process when JAX runs on the CPU.")
FLAGS = flags.FLAGS


def _fail(message: str, code: int = 2):
    line = f"train.py: error: {message}".replace("\n", " ") + "\n"
    sys.stdout.flush()
    sys.stderr.flush()
    # Our line is the last word: background threads (orbax's asyncio readers after
    # a failed restore) may still be writing tracebacks, so descriptors 1 and 2 go to
    # /dev/null before our line is written to a copy of stderr, and the interpreter
    # exits without the teardown that would wake those threads.
    err = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.write(err, line.encode())
    os._exit(code)


def _start_jax():
    import jax
    # Only the CPU backend reads this; on GPU nodes the real devices are used.
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
    if FLAGS.coordinator_address or FLAGS.distributed:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=FLAGS.coordinator_address,
                                   num_processes=FLAGS.num_processes, process_id=FLAGS.process_id)
    return jax


def main(argv):
    if len(argv) > 1:
        _fail(f"unexpected arguments: {' '.join(argv[1:])}")
    cfg = FLAGS.config
    workdir = FLAGS.workdir or os.path.join(
        "runs", os.path.splitext(os.path.basename(config_flags.get_config_filename(FLAGS["config"])))[0])
    jax = _start_jax()
    from jcomp import trainer

    logging.set_verbosity(logging.WARNING)
    try:
        last = trainer.train_and_evaluate(cfg, workdir)
    except trainer.UsageError as e:
        _fail(str(e))
    except trainer.NonFiniteError as e:
        _fail(str(e), code=1)
    if jax.process_index() == 0 and last:
        print(f"step {last['step']}: loss {last['loss']:.4f}"
              + (f", val_loss {last['val_loss']:.4f}" if "val_loss" in last else "")
              + f"; metrics in {os.path.join(workdir, 'metrics.jsonl')}")
    if FLAGS.coordinator_address or FLAGS.distributed:
        jax.distributed.shutdown()


def _parse_flags(argv):
    # A config override naming a field that does not exist (or a value of the wrong
    # type) raises from inside flag parsing, before main: one line and exit 2.
    try:
        return FLAGS(argv)
    except KeyError as e:
        text = str(e.args[0] if e.args else e)
        field = (re.findall(r"'([^']+)'", text) or [text])[0]
        hint = re.search(r'Did you mean "([^"]+)"', text)
        names = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
        where = next((n for n in names if f".{field}." in n + "." or n.endswith(f".{field}")),
                     "a --config override")
        _fail(f"{where}: the config has no field {field!r}"
              + (f" (did you mean {hint.group(1)!r}?)" if hint else ""))
    except (flags.Error, AttributeError, TypeError, ValueError) as e:
        _fail(str(e))


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
