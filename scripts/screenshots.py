"""Screenshots of the docs site as a reader sees it: headless chromium opens built pages at a
laptop's window size and saves each as a PNG, to look at after a docs change (the images are
not committed).

    uv run python scripts/screenshots.py [--build] [--out docs/_build/screenshots]
        [--pages index guides/your_task api methods] [--width 1280] [--height 900] [--full]

``--build`` builds the site first (the same ``sphinx-build`` as ``.ci/run``, into
``docs/_build/html``); without it the pages of the last build are taken. Each page gives
``OUT/<page>.png``, its first screen; ``--full`` also gives ``OUT/<page>-full.png``, the page
down to ``--full_height`` pixels. Needs Debian's ``chromium`` (``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
HTML = ROOT / "docs" / "_build" / "html"
PAGES = ("index", "guides/your_task", "api", "methods")
BUILD = ["uv", "run", "--locked", "--group", "docs", "sphinx-build", "-n", "-W", "-q", "-b",
         "html", "docs", str(HTML)]  # fmt: skip


def shoot(browser: str, page: pathlib.Path, out: pathlib.Path, width: int, height: int,
          profile: pathlib.Path) -> None:  # fmt: skip
    """One PNG of ``page`` in a ``width`` x ``height`` window (5 s of the page's own time for
    its fonts and scripts). Scrollbars are shown: a table wider than the column scrolls, and
    without its scrollbar it would look cut off."""
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                    f"--window-size={width},{height}", "--virtual-time-budget=5000",
                    f"--user-data-dir={profile}", f"--screenshot={out}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="store_true", help="build the site first")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs/_build/screenshots")
    parser.add_argument("--pages", nargs="+", default=list(PAGES),
                        help="pages by their source name, without .md")  # fmt: skip
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--full", action="store_true", help="also the page, --full_height tall")
    parser.add_argument("--full_height", type=int, default=5000)
    args = parser.parse_args(argv)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("error: needs chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    if args.build:
        subprocess.run(BUILD, cwd=ROOT, check=True)
    missing = [p for p in args.pages if not (HTML / f"{p}.html").is_file()]
    if missing:
        print(f"error: no built page for {missing} in {HTML}: pass --build, or check the "
              "names (source paths without .md)", file=sys.stderr)  # fmt: skip
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        for name in args.pages:
            flat = name.replace("/", "_")
            sizes = [(flat, args.height)] + [(f"{flat}-full", args.full_height)] * args.full
            for stem, height in sizes:
                out = args.out / f"{stem}.png"
                shoot(browser, HTML / f"{name}.html", out, args.width, height,
                      pathlib.Path(profile))  # fmt: skip
                print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
