"""``python -m diloco_jax.launch -n N [launcher flags] [--] [train flags ...]``: N processes of one
run on this machine (each ``python -m diloco_jax.train``), joined through ``jax.distributed``.

Launcher flags come before the train flags (``-h`` or ``--help`` first: every flag).
Ctrl-C (SIGINT) or SIGTERM is passed on to every process once: they agree on a step, save a
checkpoint and exit 0. A second signal kills them. If one process fails, the others are stopped.
No process outlives the launcher. If the launcher itself dies (SIGKILL included), each process
gets SIGTERM and takes the same path (or exits at once if a signal was passed on before), and
kills itself if it still runs after the grace (a ``--module`` other than train does that only if
it calls ``diloco_jax.run.preemption.watch_launcher()``). Exit status: 0, or the first failing
process's.

``--learners L`` starts a syncer (``python -m diloco_jax.syncer``) and L learners instead, each
its own run of ``--module`` with ``syncer.learner`` = I, on 127.0.0.1 over TLS with the run's
certificates and credentials (made in DIR/credentials by ``diloco-syncer certs``, kept across
restarts: each process gets its own folder, a learner its own credential); a
learner that fails does not stop the others (``--max_restarts`` starts it again, resuming from
its checkpoint; so does a syncer that fails, from its last round, while the learners retry),
the syncer is stopped when every learner has ended, and a syncer that fails for good stops the
learners. The syncer's address is chosen at the first launch and kept in DIR/syncer_address:
the same command again resumes the run (``--allow_config_change`` goes to the learners).
Ctrl-C or SIGTERM: every learner saves at its next sync and ends, then the syncer stops (the
launcher says so at once, and what a second Ctrl-C, which kills the learners, would lose); the
learners still running after ``--grace`` are killed.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

from diloco_jax.config.cli import ArgumentParser
from diloco_jax.run import local_learners
from diloco_jax.run.local_learners import free_port
from diloco_jax.run.preemption import launcher_tie

__all__ = ["child_env", "free_port", "main", "parse"]


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m diloco_jax.launch", description=__doc__,
        usage="%(prog)s -n N [launcher flags] [--] [train flags ...]",
    )  # fmt: skip
    parser.add_argument("-n", "--num_processes", type=int, metavar="N",
                        help="processes to start (required unless --learners)")  # fmt: skip
    parser.add_argument("--learners", type=int, default=0, metavar="L",
                        help="instead: a syncer and L learners, each its own run (needs "
                        "--workdir DIR: DIR/syncer, DIR/learner_I)")  # fmt: skip
    parser.add_argument("--shards", type=int, default=1, metavar="S",
                        help="with --learners: S syncer shards (syncer.shards), each its own "
                        "process: DIR/syncer (shard 0), DIR/shard_K")  # fmt: skip
    parser.add_argument("--max_restarts", type=int, default=0, metavar="K",
                        help="with --learners: a learner or the syncer that fails is started "
                        "again (resuming from its checkpoint) up to K times each")  # fmt: skip
    parser.add_argument("--devices_per_process", type=int, default=1, metavar="K",
                        help="CPU: K fake devices per process; GPU: K GPUs each")  # fmt: skip
    parser.add_argument("--port", type=int, default=0, metavar="P",
                        help="coordinator port on 127.0.0.1 (default: a free one)")  # fmt: skip
    parser.add_argument("--module", default="diloco_jax.train", metavar="M",
                        help="the module to run (default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--grace", type=float, default=30.0, metavar="SECONDS",
        help="how long stopping processes get before SIGKILL (with --learners: the learners, "
        "to reach their next sync and save; then the syncer) (default: %(default)s)",
    )  # fmt: skip
    return parser


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """``(launcher options, the rest)``: launcher flags come first; the rest (after ``--`` or
    from the first flag that is not the launcher's) goes to every process."""
    parser = _parser()
    option_names = set(parser._option_string_actions)
    end = next((i for i, arg in enumerate(argv) if arg == "--"), len(argv))
    for i, arg in enumerate(argv[:end]):  # the first train flag ends the launcher's
        takes_value = i > 0 and argv[i - 1] in option_names and "=" not in argv[i - 1]
        if not takes_value and arg.partition("=")[0] not in option_names:
            end = i
            break
    opts = parser.parse_args(argv[:end])
    if opts.num_processes is None and not opts.learners:
        parser.error("the following arguments are required: -n/--num_processes (or --learners)")
    rules = [
        ("-n", opts.num_processes is None or opts.num_processes >= 1, "must be >= 1"),
        ("-n", opts.num_processes in (None, 1) or not opts.learners,
         "must be 1 with --learners (a learner of several processes is not supported yet)"),
        ("--learners", opts.learners >= 0, "must be >= 0 (0: one run of -n processes)"),
        ("--shards", opts.shards >= 1, "must be >= 1"),
        ("--shards", opts.shards == 1 or opts.learners, "needs --learners (syncer shards)"),
        ("--max_restarts", opts.max_restarts >= 0, "must be >= 0"),
        ("--devices_per_process", opts.devices_per_process >= 1, "must be >= 1"),
        ("--port", 0 <= opts.port <= 65535, "must be in [0, 65535] (0: a free one)"),
        ("--grace", math.isfinite(opts.grace) and opts.grace >= 0, "must be >= 0 seconds"),
        ("--module", opts.module.replace(".", "").replace("_", "").isalnum(),
         "must be a module name (e.g. diloco_jax.train)"),
    ]  # fmt: skip
    for flag, ok, allowed in rules:
        if not ok:
            value = getattr(opts, parser._option_string_actions[flag].dest)
            parser.error(f"flag {flag} = {value!r} is invalid: {allowed}")
    return opts, argv[end + (argv[end : end + 1] == ["--"]) :]


def child_env(index: int, count: int, port: int, devices: int, base=os.environ) -> dict:
    """The environment of process ``index``: where to find the coordinator, who it is, which
    devices it owns."""
    env = dict(base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(index * devices + d) for d in range(devices))
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(count),
               JAX_PROCESS_ID=str(index))  # fmt: skip
    return env


class _Group:
    """The child processes; stops them all on request, kills what is left on exit."""

    def __init__(self, procs: list[subprocess.Popen], grace: float):
        self.procs, self.grace = procs, grace
        self.signalled = 0
        self.deadline: float | None = None

    def alive(self) -> list[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is None]

    def send(self, sig: int) -> None:
        for p in self.alive():
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Asks every live process to stop; they are killed if still alive after the grace."""
        self.send(sig)
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace

    def on_signal(self, signum, frame) -> None:
        del frame
        self.signalled += 1
        if self.signalled == 1:
            print(f"launch: {signal.Signals(signum).name}: asking every process to save and stop "
                  "(again to kill)", file=sys.stderr, flush=True)  # fmt: skip
            self.stop(signum)
        else:
            self.send(signal.SIGKILL)

    def wait(self) -> int:
        first_failure = 0
        while self.alive():
            for i, p in enumerate(self.procs):
                if p.poll() not in (None, 0) and not first_failure:
                    first_failure = p.returncode
                    print(f"launch: process {i} exited with status {p.returncode}; stopping the "
                          "others", file=sys.stderr, flush=True)  # fmt: skip
                    self.stop()
            if self.deadline is not None and time.monotonic() > self.deadline:
                self.send(signal.SIGKILL)
            time.sleep(0.1)
        codes = [p.returncode for p in self.procs]
        return first_failure or next((c for c in codes if c), 0)


def run_learners(opts: argparse.Namespace, rest: list[str]) -> int:
    """A syncer and ``opts.learners`` learners on this machine (see the module's docstring and
    :mod:`diloco_jax.run.local_learners`)."""
    given, rest = local_learners.split_flag(rest, "--workdir")
    workdir = local_learners.value_of(given)
    if workdir is None:
        print("error: --learners needs --workdir DIR (DIR/syncer and DIR/learner_I)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        group = local_learners.LocalLearners(opts, pathlib.Path(workdir), rest)
    except local_learners.LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return group.run()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        _parser().print_help()
        return 0
    opts, rest = parse(argv)
    if opts.learners:
        return run_learners(opts, rest)
    count, devices = opts.num_processes, opts.devices_per_process
    port = opts.port or free_port()
    group = _Group([], opts.grace)
    previous = {sig: signal.signal(sig, group.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    tie, die_with_launcher = launcher_tie(opts.grace)  # they stop when this process dies
    try:
        for i in range(count):
            # own session: a Ctrl-C in the terminal reaches the launcher only, which passes it on
            group.procs.append(subprocess.Popen(
                [sys.executable, "-m", opts.module, *rest],
                env={**child_env(i, count, port, devices), **tie}, start_new_session=True,
                preexec_fn=die_with_launcher,
            ))  # fmt: skip
        return group.wait()
    finally:
        group.send(signal.SIGKILL)  # nothing outlives the launcher, whatever happened
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
