"""The docs stay true to the code: the API page lists the package's public names, the guides name
config keys that exist, and relative links in the README and docs/ lead to files that exist.
They stay readable: short paragraphs in the guides, code that fits the column. Fast: the text is
read, nothing is trained or built (Sphinx's -W build in .ci/run checks links between the site's
pages; these tests cover what it does not see)."""

import pathlib
import re

import diloco_jax
from diloco_jax import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
API_PAGE = DOCS / "api.md"
# the pages where a user reads config keys
KEY_PAGES = [README, *(DOCS / f"{name}.md" for name in ("getting_started", "key_concepts",
             "run_folder", "install")), *sorted((DOCS / "guides").glob("*.md"))]  # fmt: skip
# a file name has the form section.word too (`train.py`); no config key ends in one of these
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "txt", "png", "csv", "sh", "npz", "toml", "gz"}
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _markdown_pages() -> list[pathlib.Path]:
    """README.md and every Markdown page under docs/ but the build's output and generated pages."""
    pages = [p for p in DOCS.rglob("*.md") if not {"_build", "_generated"} & set(p.parts)]
    return [README, *sorted(pages)]


def _without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


# --- (a) the API page and diloco_jax.__all__ --------------------------------------------------

API_ENTRY = re.compile(r"^\.\. (?:auto\w+|py:\w+):: diloco_jax\.([\w.]+)\s*$", re.M)
_MISSING = object()


def _api_entries(text: str) -> dict[str, list[str]]:
    """``{name: [members]}`` for every ``.. autoX:: diloco_jax.NAME`` (or ``.. py:X::``) entry
    of the API page, ``NAME`` also a subpackage's (``tasks.Problem``), with the names its
    ``:members:`` option lists."""
    entries, name = {}, None
    for line in text.splitlines():
        if m := API_ENTRY.match(line):
            name = m.group(1)
            entries[name] = []
        elif name and (m := re.match(r"\s+:members:\s*(.*)$", line)):
            entries[name] += [n.strip() for n in m.group(1).split(",") if n.strip()]
    return entries


def _lookup(name: str):
    """``diloco_jax.<name>`` (``name`` may be dotted: ``tasks.Problem``), or _MISSING."""
    obj = diloco_jax
    for part in name.split("."):
        obj = getattr(obj, part, _MISSING)
    return obj


def test_the_api_page_lists_every_public_name_and_only_existing_ones():
    # A failure names either a public name (in diloco_jax.__all__) that docs/api.md does not
    # document, so the site's API reference misses it (add an entry), or an entry of docs/api.md
    # (or a member it lists) that diloco_jax no longer has (remove or rename the entry).
    entries = _api_entries(API_PAGE.read_text())
    assert len(entries) > 10, "the API page's entries were not found: did its format change?"
    undocumented = sorted(set(diloco_jax.__all__) - set(entries))
    assert not undocumented, f"in diloco_jax.__all__ but not in docs/api.md: {undocumented}"
    missing = sorted(n for n in entries if _lookup(n) is _MISSING)
    missing += sorted(
        f"{n}.{m}" for n, members in entries.items() if _lookup(n) is not _MISSING
        for m in members if not hasattr(_lookup(n), m)
    )  # fmt: skip
    assert not missing, f"docs/api.md documents names diloco_jax does not have: {missing}"


# --- (b) config keys in the README and the guides ---------------------------------------------


def _mentioned_keys(text: str, sections: set[str]) -> set[str]:
    """The config keys ``text`` mentions: as ``--config.KEY=...`` (or ``--sweep KEY=...``)
    anywhere, and as inline code made only of ``section.key`` or ``section.key=value`` words,
    ``section`` being a section of the schema (``outer``, ``sim``, ...). Module paths
    (`python -m sim.combine`), calls (`model.init(...)`), file names (`metrics.jsonl`,
    `train.py`) and quoted error messages are not keys."""
    found = set(re.findall(r"--config\.([a-z_]\w*(?:\.[a-z_]\w*)?)", text))
    found |= set(re.findall(r"--sweep[ =]\"?([a-z_]\w*\.[a-z_]\w*)=", text))
    word = re.compile(rf"({'|'.join(sorted(sections))})\.([a-z_]\w*|\*)(=\S*)?")
    for span in re.findall(r"`([^`\n]+)`", _without_code_blocks(text)):
        matches = [word.fullmatch(w) for w in span.split()]
        if not all(matches):
            continue
        for m in matches:
            if not (m.group(3) is None and m.group(2) in FILE_SUFFIXES):
                found.add(f"{m.group(1)}.{m.group(2)}")
    return found


def _unknown(mentioned: set[str], keys: dict) -> list[str]:
    sections = {k.split(".")[0] for k in keys if "." in k}
    return sorted(
        k for k in mentioned
        if k not in keys and not (k.endswith(".*") and k.split(".")[0] in sections)
    )  # fmt: skip


def test_every_config_key_the_readme_and_guides_name_exists():
    # A failure names `page: key` for each config key that README.md, docs/getting_started.md or
    # a guide (docs/guides/*.md) writes as --config.KEY=... or as `section.key` but that the
    # config schema (diloco_jax/config/schema.py) does not have: a misspelt or renamed key, which a
    # user copying it would see refused. Fix the page (or the schema, if the key was lost).
    keys = config_lib.keys()
    assert not any(k.rsplit(".", 1)[-1] in FILE_SUFFIXES for k in keys)
    sections = {k.split(".")[0] for k in keys if "." in k}
    bad, seen = [], set()
    for page in KEY_PAGES:
        mentioned = _mentioned_keys(page.read_text(), sections)
        seen |= mentioned
        bad += [f"{page.relative_to(ROOT)}: {k}" for k in _unknown(mentioned, keys)]
    assert len(seen) > 50, f"only {len(seen)} keys found: did the pattern stop matching?"
    assert not bad, f"config keys that do not exist: {bad}"


def test_the_key_scan_finds_keys_and_skips_what_only_looks_like_one():
    sections = {"outer", "train", "sim", "model"}
    text = (
        "`outer.sync_evry` and `outer.momentum=0 outer.nesterov=false`, --config.train.bogus=1,\n"
        '--sweep "sim.speeds=[],[1,1]"; not: `train.py`, `metrics.jsonl`, `diloco_jax.train`,\n'
        "`python -m sim.combine`, `model.init(...)`, `error: unknown key 'outer.nope'`\n"
        "```bash\n--config.sim.in_a_block=1\n```\n"
    )
    assert _mentioned_keys(text, sections) == {
        "outer.sync_evry", "outer.momentum", "outer.nesterov", "train.bogus", "sim.speeds",
        "sim.in_a_block",
    }  # fmt: skip
    assert _unknown({"outer.sync_evry", "log.*", "nope.*"}, config_lib.keys()) == [
        "nope.*",
        "outer.sync_evry",
    ]


# --- (c) relative links -----------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")


def _slug(heading: str) -> str:
    """A heading's anchor as MyST (``myst_heading_anchors``) and GitHub write it."""
    text = re.sub(r"`|\*\*?|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    text = _without_code_blocks(page.read_text())
    return {_slug(h) for h in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M)}


def _broken_links(page: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """The relative links of ``page`` whose file does not exist, or whose #fragment names no
    heading of the Markdown page it points to."""
    broken = []
    for target in LINK.findall(_without_code_blocks(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s):, mailto:, ... and anchors within the page (Sphinx checks those)
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve()
        if not file.exists():
            broken.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif fragment and file.suffix == ".md" and fragment not in _anchors(file):
            broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def test_relative_links_in_the_readme_and_docs_lead_somewhere():
    # A failure names `page: target (why)` for a link of README.md or a docs/ page that points
    # into the repository at a file that does not exist (moved, renamed, or a wrong number of
    # ../), or at a #heading the target page does not have. Sphinx -W sees neither README.md
    # (not part of the site) nor links from docs/ to files outside it (../examples/x.py).
    pages = _markdown_pages()
    assert README in pages and DOCS / "guides" / "methods.md" in pages
    broken = [b for page in pages for b in _broken_links(page)]
    assert not broken, f"broken relative links: {broken}"


def test_the_link_check_reports_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# A page: `with code`\n\n## Second\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md) [ok](a.md#a-page-with-code) [ok](a.md#second) [web](https://x.org/y)\n"
        "[gone](c.md) [no heading](a.md#third) [ok](#local)\n```\n[in code](d.md)\n```\n"
    )
    assert _broken_links(page, root=tmp_path) == [
        "b.md: c.md (no such file)",
        "b.md: a.md#third (no such heading)",
    ]


def test_every_config_section_introduces_itself():
    # The configuration reference opens each section with its dataclass's docstring. A section
    # without one would show the dataclass's generated signature (`DataConfig(corpus: ...)`),
    # so each needs its own: a failure names the classes to give one.
    import dataclasses

    sections = [type(getattr(config_lib.Config(), f.name))
                for f in dataclasses.fields(config_lib.Config)]  # fmt: skip
    sections = [c for c in sections if dataclasses.is_dataclass(c)]
    assert len(sections) > 10
    bare = [c.__name__ for c in sections
            if not c.__doc__ or c.__doc__.startswith(f"{c.__name__}(")]  # fmt: skip
    assert not bare, f"config sections without a docstring: {bare}"


def test_no_paragraph_line_starts_a_blockquote_by_accident():
    # A wrapped line that begins with ">" (as in ">= 1") turns the rest of its paragraph into a
    # blockquote. A failure names `page:line`: rewrap the paragraph so that no line starts so.
    bad = []
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        if "_build" in page.parts or "_generated" in page.parts:
            continue
        fenced, before = False, ""
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and line.startswith(">") and before.strip() and (
                    not before.startswith(">")):  # fmt: skip
                bad.append(f"{page.relative_to(ROOT)}:{number}")
            before = line
    assert not bad, f"lines that start a blockquote inside a paragraph: {bad}"


def test_page_titles_are_unique():
    # Two pages with one title are two identical entries in the table of contents and the
    # search results. A failure names the title and its pages: rename one.
    titles: dict[str, list[str]] = {}
    pages = [(p.relative_to(ROOT), p.read_text()) for p in DOCS.rglob("*.md")
             if "_build" not in p.parts and "_generated" not in p.parts]  # fmt: skip
    # the configuration reference is generated by docs/conf.py: its title is a line there
    generated = re.findall(r'^\s*"(# [^"]+)",$', (DOCS / "conf.py").read_text(), re.M)
    assert generated, "docs/conf.py writes no page title any more: update this test"
    pages += [(pathlib.Path("docs/conf.py"), title) for title in generated]
    for path, text in pages:
        first = next((line for line in text.splitlines() if line.startswith("# ")), None)
        if first:
            titles.setdefault(first[2:].strip(), []).append(str(path))
    repeated = {t: p for t, p in titles.items() if len(p) > 1}
    assert not repeated, f"page titles used twice: {repeated}"


# --- (d) readable: short paragraphs, code that fits the column --------------------------------

# the pages a user reads through; the reference pages (architecture, benchmarks, testing) are
# looked things up in, and keep their longer paragraphs
GUIDE_PAGES = [README, *(DOCS / f"{name}.md" for name in ("index", "getting_started",
               "key_concepts", "run_folder", "install", "examples", "tutorial")),
               *sorted((DOCS / "guides").glob("*.md"))]  # fmt: skip
MOST_WORDS = 150
# characters of a code line the site's column shows whole (sphinx-book-theme at a 1280 px
# window; scripts/screenshots.py takes the pages at that width)
COLUMN = 80
DIRECTIVE_FENCE = re.compile(r"^(`{3,}|~{3,})\{(?!code-cell)")  # {include}, {toctree}, ...


def _paragraphs(text: str):
    """``(line, words)`` per paragraph outside code blocks: a list item starts one, and
    headings, tables, HTML comments and directive options end one."""
    start, words, fenced = 0, 0, None
    for number, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if fenced or re.match(r"^(`{3,}|~{3,})", s):
            fenced = (None if fenced and s.startswith(fenced) else
                      fenced or re.match(r"^(`{3,}|~{3,})", s).group(1))  # fmt: skip
            s = ""
        ends = not s or s[0] in "#|<:" or s == "---"
        item = re.match(r"^([-*+]|\d+\.)\s+", s)
        if ends or item:
            if words:
                yield start, words
            words = 0
            if ends:
                continue
            s = s[item.end() :]
        start = start if words else number
        words += len(s.split())
    if words:
        yield start, words


def _where(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT) if page.is_relative_to(ROOT) else page)


def _code_lines(page: pathlib.Path):
    """``(where, line)`` for every line of the page's code blocks (a ``{code-cell}`` included),
    and of the file (or the part between its markers) an ``{include}`` or ``{literalinclude}``
    brings in."""
    text = page.read_text()
    for block in re.finditer(r"^(`{3,})([^\n]*)\n(.*?)^\1\s*$", text, re.S | re.M):
        first = text[: block.start()].count("\n") + 2
        if re.match(r"\{(literal)?include\}", block.group(2)):
            source = (page.parent / block.group(2).split(None, 1)[1].strip()).resolve()
            body = source.read_text()
            if after := re.search(r":start-after: (.*)", block.group(3)):
                body = body.split(after.group(1), 1)[1]
            if before := re.search(r":end-before: (.*)", block.group(3)):
                body = body.split(before.group(1), 1)[0]
            yield from ((f"{_where(page)}:{first - 1} ({source.name})", line)
                        for line in body.splitlines() if not line.startswith("```"))  # fmt: skip
        elif not DIRECTIVE_FENCE.match(block.group(0)):
            for offset, line in enumerate(block.group(3).splitlines()):
                yield f"{_where(page)}:{first + offset}", line


def test_no_guide_paragraph_is_a_wall_of_text():
    # A failure names `page:line (words)`: split the paragraph, or make it a list.
    long = [f"{page.relative_to(ROOT)}:{line} ({words})" for page in GUIDE_PAGES
            for line, words in _paragraphs(page.read_text()) if words > MOST_WORDS]  # fmt: skip
    assert not long, f"paragraphs over {MOST_WORDS} words: {long}"


def test_the_paragraph_count_sees_items_code_and_tables():
    text = "one two\nthree\n\n- four five\n- six\n\n```\nnot words here\n```\n| a | b |\nseven\n"
    assert list(_paragraphs(text)) == [(1, 3), (4, 2), (5, 1), (11, 1)]


def test_code_lines_fit_the_column():
    # The site cuts a longer line off at the column's edge. A failure names `page:line (width)`:
    # wrap it (a backslash, a magic trailing comma, a comment of its own).
    pages = [p for p in _markdown_pages() if p != README]
    wide = [f"{where} ({len(line)})" for page in pages for where, line in _code_lines(page)
            if len(line) > COLUMN]  # fmt: skip
    assert not wide, f"code lines wider than {COLUMN} characters: {wide}"


def test_the_code_line_scan_reads_includes_and_skips_directives(tmp_path):
    (tmp_path / "source.md").write_text(
        "x\n<!-- a -->\n```python\n" + "y" * 90 + "\n```\n<!-- /a -->\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "```{include} source.md\n:start-after: <!-- a -->\n:end-before: <!-- /a -->\n"
        "```\n\n```{toctree}\n" + "z" * 90 + "\n```\n\n```bash\nshort\n```\n"
    )
    lines = [line for _, line in _code_lines(page) if line]
    assert lines == ["y" * 90, "short"]


def test_the_task_guide_opens_on_array_task_code():
    # The first screen of "Bring your own task" shows the task example (README's, included).
    text = (DOCS / "guides" / "your_task.md").read_text()
    first_block = text.index("```")
    assert text[:first_block].count("\n") < 8, "the task guide's example moved down the page"
    assert text[first_block:].startswith("```{include} ../../README.md")
    example = README.read_text().split("<!-- task-example -->", 1)[1]
    assert "diloco_jax.ArrayTask(" in example.split("<!-- /task-example -->")[0]
