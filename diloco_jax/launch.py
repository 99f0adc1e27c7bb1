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
learners.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from diloco_jax.base.access import TOKEN_ENV
from diloco_jax.config.cli import ArgumentParser
from diloco_jax.run.preemption import launcher_tie


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        help="how long stopping processes get before SIGKILL (default: %(default)s)",
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


def split_workdir(rest: list[str]) -> tuple[str | None, list[str]]:
    """``(the --workdir value or None, the flags without it)``."""
    for i, arg in enumerate(rest):
        if arg == "--workdir" and i + 1 < len(rest):
            return rest[i + 1], rest[:i] + rest[i + 2 :]
        if arg.startswith("--workdir="):
            return arg.partition("=")[2], rest[:i] + rest[i + 1 :]
    return None, rest


def _wait_for_port(port: int, proc: subprocess.Popen, seconds: float = 120.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.2)
    return False


def _say(text: str) -> None:
    print(f"launch: {text}", file=sys.stderr, flush=True)


class _Learners:
    """A syncer and its learners as child processes, each started again when it fails (up to
    ``--max_restarts`` times); see the module's docstring."""

    def __init__(self, opts: argparse.Namespace, workdir: str, rest: list[str]):
        self.opts, self.workdir, self.count = opts, workdir, opts.learners
        self.port = free_port()
        # mutual TLS, as across networks: each learner shows its own certificate too
        self.common = [*rest, f"--config.syncer.address=127.0.0.1:{self.port}",
                       f"--config.syncer.learners={self.count}",
                       "--config.syncer.mutual_tls=true"]  # fmt: skip
        from diloco_jax.base import extras

        extras.require("cryptography", "learners and a syncer")
        from diloco_jax.learners import certs

        self.credentials = pathlib.Path(workdir) / "credentials"
        certs.make(self.credentials, self.count, list(certs.DEFAULT_HOSTS), log=lambda _: None)
        env = dict(os.environ)
        env.pop(TOKEN_ENV, None)  # each process's credential is in its own folder
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if "host_platform_device_count" not in f]  # fmt: skip
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count="
                                             f"{opts.devices_per_process}"])  # fmt: skip
        tie, self._die_with_launcher = launcher_tie(opts.grace)
        self.env = {**env, **tie}
        self.group = _Group([], opts.grace)
        self.restarts = [0] * (self.count + 1)  # the last: the syncer's
        self.ended: set[int] = set()
        self.failure = 0

    def _start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", *args], env=self.env,
                                start_new_session=True,
                                preexec_fn=self._die_with_launcher)  # fmt: skip

    def _learner(self, i: int) -> subprocess.Popen:
        return self._start(
            self.opts.module,
            "--workdir",
            f"{self.workdir}/learner_{i}",
            *self.common,
            f"--config.syncer.learner={i}",
            f"--config.syncer.credentials={self.credentials / f'learner_{i}'}",
        )

    def _syncer(self) -> subprocess.Popen:
        return self._start(
            "diloco_jax.syncer",
            "--workdir",
            f"{self.workdir}/syncer",
            *self.common,
            f"--config.syncer.credentials={self.credentials / 'syncer'}",
        )

    def _again(self, slot: int, what: str, code: int) -> bool:
        """Whether ``what`` (slot ``slot``) is to be started again after exiting with ``code``."""
        if not code or self.group.deadline is not None:
            return False
        if self.restarts[slot] >= self.opts.max_restarts:
            return False
        self.restarts[slot] += 1
        _say(f"{what} exited with status {code}; starting it again ({self.restarts[slot]} of "
             f"{self.opts.max_restarts})")  # fmt: skip
        return True

    def _check(self) -> None:
        """One look at every process: restarts, failures, the end of learners."""
        procs = self.group.procs
        if procs[0].poll() is not None and self.group.deadline is None:
            code = procs[0].returncode
            if self._again(self.count, "the syncer", code):  # the learners retry meanwhile
                procs[0] = self._syncer()
            else:
                _say(f"the syncer exited with status {code}; stopping the learners")
                self.failure = code or 1
                self.group.stop()
        for i in range(self.count):
            code = procs[1 + i].poll()
            if code is None or i in self.ended:
                continue
            if self._again(i, f"learner {i}", code):
                procs[1 + i] = self._learner(i)
                continue
            self.ended.add(i)
            if code and self.group.deadline is None:
                self.failure = self.failure or code
                _say(f"learner {i} exited with status {code}; the others go on")

    def run(self) -> int:
        group = self.group
        previous = {sig: signal.signal(sig, group.on_signal)
                    for sig in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
        try:
            group.procs.append(self._syncer())
            if not _wait_for_port(self.port, group.procs[0]):
                _say("the syncer did not start listening")
                return group.procs[0].wait() or 1
            _say(f"syncer at 127.0.0.1:{self.port} (workdir {self.workdir}/syncer), "
                 f"{self.count} learners")  # fmt: skip
            group.procs += [self._learner(i) for i in range(self.count)]
            while len(self.ended) < self.count:
                self._check()
                if group.deadline is not None and time.monotonic() > group.deadline:
                    group.send(signal.SIGKILL)
                time.sleep(0.1)
            group.stop()  # every learner has ended: the syncer's last round is already written
            while group.procs[0].poll() is None:
                if time.monotonic() > (group.deadline or 0.0):
                    group.send(signal.SIGKILL)
                time.sleep(0.1)
            learners = group.procs[1:]
            return self.failure or next((p.returncode for p in learners if p.returncode), 0)
        finally:
            group.send(signal.SIGKILL)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_learners(opts: argparse.Namespace, rest: list[str]) -> int:
    """A syncer and ``opts.learners`` learners on this machine (see the module's docstring)."""
    workdir, rest = split_workdir(rest)
    if workdir is None:
        print("error: --learners needs --workdir DIR (DIR/syncer and DIR/learner_I)",
              file=sys.stderr)  # fmt: skip
        return 2
    return _Learners(opts, workdir, rest).run()


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
