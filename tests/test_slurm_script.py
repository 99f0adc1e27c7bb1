"""scripts/slurm_train.sbatch without a cluster: ``srun``, ``scontrol`` and ``uv`` are stand-ins
on PATH that log their calls. At the time-limit signal (USR1) the script must pass SIGTERM to
srun, wait for it and requeue the job; the environment is synced once, before srun."""

import os
import pathlib
import signal
import subprocess
import time

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "slurm_train.sbatch"
STAND_INS = {
    "uv": 'echo "uv $*" >> "$LOG"',
    "scontrol": 'echo "scontrol $*" >> "$LOG"',
    # srun passes SIGTERM on to its tasks; the stand-in task saves and exits 0 when it gets one
    # (its trap is set before it logs, so a logged srun is ready for the signal)
    "srun": 'trap \'kill "$task"; echo "task got TERM" >> "$LOG"; exit 0\' TERM\n'
            'echo "srun $*" >> "$LOG"\n'
            'sleep 60 > /dev/null & task=$!\nwait',
}  # fmt: skip


def _log(path: pathlib.Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_time_limit_signal_stops_the_run_then_requeues(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "t", "SLURM_SUBMIT_DIR": str(tmp_path),
           "RUN": str(tmp_path / "run"), "PYTHON": "python3"}  # fmt: skip
    job = subprocess.Popen(["bash", str(SCRIPT)], env=env, text=True, stdout=subprocess.PIPE)
    deadline = time.time() + 20
    while not any(line.startswith("srun") for line in _log(log)):
        assert time.time() < deadline and job.poll() is None, _log(log)
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    out, _ = job.communicate(timeout=20)
    assert job.returncode == 0, out
    calls = _log(log)
    assert calls[0] == "uv sync --locked --extra cuda12"  # once, before the tasks start
    assert calls[1].startswith("srun --kill-on-bad-exit=1 python3 -m diloco_jax.train")
    assert f"--workdir {tmp_path / 'run'}" in calls[1] and "--config default" in calls[1]
    assert calls[2:] == ["task got TERM", "scontrol requeue 42"], calls
    assert "requeueing job 42" in out
