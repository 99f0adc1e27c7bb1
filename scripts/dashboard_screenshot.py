"""The dashboard screenshot of docs/guides/watching.md, taken during a real run: the default
training job with ``serve.port`` in a subprocess; once it has passed ``--at`` steps, headless
chromium saves the page as a PNG; then the run is stopped over HTTP (``POST /control/stop``:
checkpoint, exit 0).

    uv run python scripts/dashboard_screenshot.py [--out docs/dashboard.png] [--at 600]

Needs Debian's ``chromium`` (``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _request(port: int, method: str, path: str, headers=None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body="{}" if method == "POST" else None, headers=headers or {})
    response = conn.getresponse()
    return response.status, response.read()


def _status(port: int) -> dict | None:
    try:
        code, body = _request(port, "GET", "/status")
    except OSError:
        return None
    return json.loads(body) if code == 200 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/dashboard.png")
    parser.add_argument("--at", type=int, default=600, help="screenshot after this many steps")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("error: needs chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = pathlib.Path(tempfile.mkdtemp(prefix="dashboard-"))
    token = "screenshot"
    env = {**os.environ, "DILOCO_SERVE_TOKEN": token, "TQDM_DISABLE": "1"}
    command = [sys.executable, "-m", "diloco_jax.train", "--workdir", str(work / "run"),
               f"--config.serve.port={port}"]  # fmt: skip
    run = subprocess.Popen(command, cwd=ROOT, env=env)
    try:
        while (status := _status(port)) is None or status["step"] < args.at:
            if run.poll() is not None:
                print("error: the run ended before the screenshot", file=sys.stderr)
                return 1
            time.sleep(1)
        time.sleep(3)  # the page polls every 2 s
        out = (ROOT / args.out).resolve()
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", "--window-size=1400,1150",
                        "--virtual-time-budget=5000", f"--user-data-dir={work / 'profile'}",
                        f"--screenshot={out}", f"http://127.0.0.1:{port}/"],
                       check=True, capture_output=True, timeout=120)  # fmt: skip
        print(f"wrote {out} at step {status['step']}")
        _request(port, "POST", "/control/stop", {"Authorization": f"Bearer {token}"})
        return run.wait(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
