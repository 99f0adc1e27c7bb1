"""``diloco-launch --learners L``: a syncer and L learners as child processes on this machine
(:mod:`diloco_jax.launch` parses the command line; :class:`LocalLearners` runs them).

- **One run per workdir, resumed by the same command.** The syncer's address is chosen at the
  workdir's first launch and kept in ``WORKDIR/syncer_address`` (:func:`kept_address`), so a
  second launch of the same command resumes every learner from its checkpoint and the syncer
  from its last round. A learner's checkpoint holds its whole config, ``syncer.address``
  included, and a resume that changes it is refused as any training key is: keeping the port
  keeps every key equal, where exempting the address from the check would also let a learner
  pointed at another run's syncer by mistake through. ``--allow_config_change`` goes to the
  learners alone (the syncer compares no config).
- **A clean stop.** SIGTERM or Ctrl-C asks every learner to stop: each saves at its next sync
  (at once if it is between rounds) and leaves; only once they have all ended (or ``--grace``
  seconds have passed and the rest are killed) is the syncer stopped, so that their last
  round closes. A second signal kills the learners at once; both say, from the learners'
  metrics and checkpoints, how many steps that loses (:func:`at_risk`).
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from diloco_jax.base.access import TOKEN_ENV
from diloco_jax.run.preemption import SIGNALS, launcher_tie

ADDRESS_FILE = "syncer_address"  # in the launch's workdir: the run's syncer address


class LaunchError(ValueError):
    """A launch refused before anything started; the message is one line."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def port_taken(host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` (a bind as gRPC's, with ``SO_REUSEADDR``: the
    closed connections of the run's last syncer do not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _first_address(workdir: pathlib.Path) -> str | None:
    """Learner 0's ``syncer.address`` at its first start (a run launched before the address
    was kept), or None."""
    try:
        config = json.loads((workdir / "learner_0" / "config.json").read_text())
        return str(config["syncer"]["address"]) or None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def kept_address(workdir: pathlib.Path, given: str | None = None, taken=port_taken,
                 shards: int = 1) -> str:  # fmt: skip
    """The run's syncer address (with ``shards`` S > 1, the S shards' addresses, comma-
    separated): ``given`` (``--config.syncer.address``), else the one kept in
    ``workdir/syncer_address``, else learner 0's first config's, else 127.0.0.1 and free
    ports; written to that file, where a later launch finds it. Raises :class:`LaunchError`
    where something listens on one already (``taken(host, port)``), or for another count of
    addresses than shards."""
    path = workdir / ADDRESS_FILE
    kept = path.read_text().strip() if path.is_file() else _first_address(workdir)
    address = given or kept or ",".join(f"127.0.0.1:{free_port()}" for _ in range(shards))
    where = "given" if given else f"kept in {path}"
    each = address.split(",")
    if len(each) != shards:
        raise LaunchError(f"the run's syncer address {address} ({where}) names "
                          f"{len(each)} syncer(s), but --shards is {shards}: a run keeps its "
                          "shards")  # fmt: skip
    for one in each:
        try:
            host, port = host_port(one)
        except ValueError:
            raise LaunchError(f"config key syncer.address = {one!r} is not HOST:PORT") from None
        if taken(host, port):
            raise LaunchError(
                f"the run's syncer address {one} ({where}) is taken by another process: stop "
                "it, or move the run with --config.syncer.address=127.0.0.1:PORT[,...] "
                "--allow_config_change"
            )
    if address != kept or not path.is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        path.write_text(address + "\n")
    return address


def split_flag(rest: list[str], name: str, takes_value: bool = True):
    """``(the flags of ``name`` as given, the others)``: ``NAME=V``, ``NAME V`` (``takes_value``:
    always; else only a V that is not a flag), or ``NAME`` alone."""
    found, others, i = [], [], 0
    while i < len(rest):
        arg = rest[i]
        if arg.partition("=")[0] != name:
            others.append(arg)
        elif "=" in arg or i + 1 == len(rest) or (not takes_value and rest[i + 1][:1] == "-"):
            found.append(arg)
        else:
            found += rest[i : i + 2]
            i += 1
        i += 1
    return found, others


def value_of(flags: list[str]) -> str | None:
    """The value of the last of ``flags`` (:func:`split_flag`'s), or None (none, or a flag
    alone)."""
    if not flags or (flags[-1].startswith("--") and "=" not in flags[-1]):
        return None
    return flags[-1].partition("=")[2] if flags[-1].startswith("--") else flags[-1]


def _progress(workdir: pathlib.Path) -> tuple[int, int]:
    """``(the last step a learner's metrics.jsonl reports, its newest checkpoint's step)``."""
    trained, saved = 0, 0
    try:
        with open(workdir / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 16)))  # its tail: a run's file is long
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the tail's first line, cut
        if isinstance(event, dict) and event.get("event") == "train":
            trained = int(event["step"])
            break
    checkpoints = workdir / "checkpoints"
    if checkpoints.is_dir():
        saved = max([int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()], default=0)
    return trained, saved


def at_risk(workdir: pathlib.Path, count: int) -> str:
    """What killing the learners now loses: ``losing up to N steps (learner I: steps A-B, ...)``,
    each learner's steps trained since its newest checkpoint (it trains them again when
    resumed)."""
    parts, worst = [], 0
    for i in range(count):
        trained, saved = _progress(workdir / f"learner_{i}")
        if trained > saved:
            parts.append(f"learner {i}: steps {saved:,}-{trained:,}")
            worst = max(worst, trained - saved)
    if not parts:
        return "losing no steps (every learner is at its checkpoint)"
    return f"losing up to {worst:,} steps ({', '.join(parts)})"


def _say(text: str) -> None:
    print(f"launch: {text}", file=sys.stderr, flush=True)


def _send(procs: list, sig: int) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


class LocalLearners:
    """A syncer and its learners as child processes, each started again when it fails (up to
    ``--max_restarts`` times), stopped in order (see the module's docstring). ``opts``: the
    launcher's options; ``rest``: the flags every process gets (``--workdir`` taken out)."""

    def __init__(self, opts, workdir: pathlib.Path, rest: list[str]):
        self.opts, self.workdir, self.count = opts, workdir, opts.learners
        self.shards = getattr(opts, "shards", 1)
        self.allow, rest = split_flag(rest, "--allow_config_change", takes_value=False)
        given, rest = split_flag(rest, "--config.syncer.address")
        _, rest = split_flag(rest, "--config.syncer.shards")  # the launcher's --shards says
        self.address = kept_address(workdir, value_of(given), shards=self.shards)
        # mutual TLS, as across networks: each learner shows its own certificate too
        self.common = [*rest, f"--config.syncer.address={self.address}",
                       f"--config.syncer.learners={self.count}",
                       f"--config.syncer.shards={self.shards}",
                       "--config.syncer.mutual_tls=true"]  # fmt: skip
        from diloco_jax.base import extras

        extras.require("cryptography", "learners and a syncer")
        from diloco_jax.learners import certs

        self.credentials = workdir / "credentials"
        certs.make(self.credentials, self.count, list(certs.DEFAULT_HOSTS), log=lambda _: None,
                   shards=self.shards)  # fmt: skip
        env = dict(os.environ)
        env.pop(TOKEN_ENV, None)  # each process's credential is in its own folder
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if "host_platform_device_count" not in f]  # fmt: skip
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count="
                                             f"{opts.devices_per_process}"])  # fmt: skip
        tie, self._die_with_launcher = launcher_tie(opts.grace)
        self.env = {**env, **tie}
        self.syncers: list[subprocess.Popen] = []  # shard 0 (the syncer) first
        self.learners: list[subprocess.Popen] = []
        self.restarts = [0] * (self.count + self.shards)  # the last: the syncer shards'
        self.ended: set[int] = set()
        self.failure, self.signals = 0, 0
        self.deadline: float | None = None  # set once the learners are asked to stop
        self.syncer_ended = False  # failed for good, or stopped

    def learner_argv(self, i: int) -> list[str]:
        return ["-m", self.opts.module, "--workdir", str(self.workdir / f"learner_{i}"),
                *self.common, f"--config.syncer.learner={i}",
                f"--config.syncer.credentials={self.credentials / f'learner_{i}'}",
                *self.allow]  # fmt: skip

    def syncer_argv(self, k: int = 0) -> list[str]:
        # it stays until stopped: the launcher stops it once the learners have ended
        folder = "syncer" if k == 0 else f"shard_{k}"  # its workdir and its credentials
        return ["-m", "diloco_jax.syncer", "--workdir", str(self.workdir / folder),
                *self.common, f"--config.syncer.credentials={self.credentials / folder}",
                f"--config.syncer.shard={k}", "--config.syncer.stay=true"]  # fmt: skip

    def _syncer_name(self, k: int) -> str:
        return "the syncer" if self.shards == 1 else f"syncer shard {k}"

    def _start(self, argv: list[str]) -> subprocess.Popen:
        # own session: a Ctrl-C in the terminal reaches the launcher only, which passes it on
        return subprocess.Popen([sys.executable, *argv], env=self.env, start_new_session=True,
                                preexec_fn=self._die_with_launcher)  # fmt: skip

    def on_signal(self, signum, frame) -> None:
        """The first signal asks the learners to save at their next sync; the second kills
        them (and the syncer, once it is being stopped); a third kills the syncer too. Each
        says what it does at once."""
        del frame
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals == 1:
            _say(f"{name}: stopping: learners save at their next sync, then the syncer stops; "
                 f"Ctrl-C again to stop at once, {at_risk(self.workdir, self.count)}")  # fmt: skip
            self.stop_learners()
            return
        if self.signals == 2:
            _say(f"{name} again: stopping at once, {at_risk(self.workdir, self.count)}")
        _send(self.learners, signal.SIGKILL)
        if self.signals > 2 or self.syncer_ended:
            _send(self.syncers, signal.SIGKILL)

    def stop_learners(self) -> None:
        """Asks every learner to save at its next sync and end; ``--grace`` seconds later the
        ones still running are killed (:meth:`run`)."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.opts.grace
        _send(self.learners, signal.SIGTERM)

    def _again(self, slot: int, what: str, code: int) -> bool:
        """Whether ``what`` (slot ``slot``) is to be started again after exiting with ``code``:
        not a learner asked to stop (the syncer is, while the learners save)."""
        if not code or (slot < self.count and self.deadline is not None):
            return False
        if self.restarts[slot] >= self.opts.max_restarts:
            return False
        self.restarts[slot] += 1
        _say(f"{what} exited with status {code}; starting it again ({self.restarts[slot]} of "
             f"{self.opts.max_restarts})")  # fmt: skip
        return True

    def _check(self) -> None:
        """One look at every process: restarts, failures, the end of learners."""
        for k, syncer in enumerate(self.syncers):
            code = syncer.poll()
            if code is None or self.syncer_ended:
                continue
            name = self._syncer_name(k)
            if self._again(self.count + k, name, code):  # the learners retry meanwhile
                self.syncers[k] = self._start(self.syncer_argv(k))
            else:
                _say(f"{name} exited with status {code}; stopping the learners")
                self.failure, self.syncer_ended = code or 1, True
                self.stop_learners()
        for i, p in enumerate(self.learners):
            code = p.poll()
            if code is None or i in self.ended:
                continue
            if self._again(i, f"learner {i}", code):
                self.learners[i] = self._start(self.learner_argv(i))
                continue
            self.ended.add(i)
            if code and self.deadline is None:
                self.failure = self.failure or code
                _say(f"learner {i} exited with status {code}; the others go on")

    def _listening(self, seconds: float = 120.0) -> bool:
        """Whether every syncer shard listens within ``seconds`` (False: one ended, or a
        signal came)."""
        end = time.monotonic() + seconds
        for syncer, address in zip(self.syncers, self.address.split(","), strict=True):
            host, port = host_port(address)
            while True:
                if time.monotonic() > end or syncer.poll() is not None or self.signals:
                    return False
                with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                    if s.connect_ex((host, port)) == 0:
                        break
                time.sleep(0.2)
        return True

    def _kill_late(self) -> None:
        """Kills the learners still running ``--grace`` seconds after they were asked to stop,
        saying what that loses."""
        grace, risk = self.opts.grace, at_risk(self.workdir, self.count)
        _say(f"learners still running {grace:g} s after the stop (--grace): killing them, {risk}")
        self.deadline = float("inf")  # said once
        _send(self.learners, signal.SIGKILL)

    def stop_syncer(self) -> None:
        """SIGTERM to the syncer (its last round is written), SIGKILL after ``--grace``."""
        self.syncer_ended = True
        _send(self.syncers, signal.SIGTERM)
        end = time.monotonic() + self.opts.grace
        while any(s.poll() is None for s in self.syncers):
            if time.monotonic() > end:
                _send(self.syncers, signal.SIGKILL)
            time.sleep(0.1)

    def say_page(self) -> None:
        """Says where the syncer's status page is, where ``--config.syncer.status_port`` asks
        for one (mutual TLS, as the learners': a browser shows the operator's certificate)."""
        port = value_of(split_flag(self.common, "--config.syncer.status_port")[0])
        if not port or not port.isdigit() or not int(port):
            return
        host = host_port(self.address.split(",")[0])[0]
        host, operator = f"[{host}]" if ":" in host else host, self.credentials / "operator"
        _say(f"the syncer's status page: https://{host}:{port}/ in a browser holding the "
             f"operator's certificate ({operator}); sign in with the one-time link in the "
             f"syncer's log, or with the credential in {operator}/token")  # fmt: skip

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self.on_signal) for sig in SIGNALS}
        try:
            self.syncers = [self._start(self.syncer_argv(k)) for k in range(self.shards)]
            if not self._listening() and not self.signals:
                _say("the syncer did not start listening" if self.shards == 1 else
                     "a syncer shard did not start listening")  # fmt: skip
                return next((c for c in (s.poll() for s in self.syncers) if c), 1)
            if not self.signals:
                where = (f"syncer at {self.address} (workdir {self.workdir}/syncer)"
                         if self.shards == 1 else f"{self.shards} syncer shards at "
                         f"{self.address} (workdirs {self.workdir}/syncer, shard_K)")  # fmt: skip
                _say(f"{where}, {self.count} learners")
                self.say_page()
                self.learners = [self._start(self.learner_argv(i)) for i in range(self.count)]
            while len(self.ended) < len(self.learners):
                self._check()
                if self.deadline is not None and time.monotonic() > self.deadline:
                    self._kill_late()
                time.sleep(0.1)
            self.stop_syncer()  # every learner has ended: its last round is already written
            codes = [p.returncode for p in self.learners]
            return self.failure or next((c for c in codes if c), 0)
        finally:
            _send([*self.syncers, *self.learners], signal.SIGKILL)  # nothing outlives it
            for sig, handler in previous.items():
                signal.signal(sig, handler)
