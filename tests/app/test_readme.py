"""README.rst and the manual (docs/): they render, document every setting and fault, show the
layout as it is, and the README's curl session is what the service answers."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, tzinfo
from pathlib import Path
from urllib.parse import urlsplit

import docutils.core
import docutils.utils
import pytest
import yaml
from click.testing import CliRunner
from flask.testing import FlaskClient

from petstore import config, db
from petstore.cli import main
from petstore.queries import usage as usage_sql
from petstore.ratelimit.limiter import STORAGE_RECHECK_SECONDS
from petstore.views import usage as usage_view
from tests.support.checks import pass_key_cache_bound

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.rst"
DOCS = ROOT / "docs"
README_LINES = 250
# Written by gunicorn (the test client has none of them): shown, not compared.
SERVER_HEADERS = ("Server", "Date", "Connection")
# Values that differ on every run: compared by shape only.
VOLATILE = [
    (re.compile(r"^(X-Request-ID: )[0-9a-f]{32}$", re.M), r"\g<1>ID"),
    (re.compile(r"^(X-RateLimit-Reset: )\d+$", re.M), r"\g<1>RESET"),
    (re.compile(r'^(RateLimit: "\w+";r=\d+;t=)\d+$', re.M), r"\g<1>T"),
    (re.compile(r"^(Retry-After: )\d+$", re.M), r"\g<1>SECONDS"),
    (re.compile(r"ps_[A-Za-z0-9_-]{43}"), "KEY"),
    (re.compile(r"ps_[A-Za-z0-9_-]{8}"), "PREFIX"),
    (re.compile(r'("(?:reset|until)": )\d+'), r"\g<1>UNIX"),
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d\+\d\d:?\d\d"), "INSTANT"),
]


def manual() -> dict[Path, str]:
    """README.rst and every page of docs/, by path: the places a reader looks things up."""
    pages = [README, *sorted(DOCS.glob("**/*.rst"))]
    return {path: path.read_text(encoding="utf-8") for path in pages if "_build" not in path.parts}


def all_docs() -> str:
    return "\n".join(manual().values())


@pytest.mark.parametrize("name", ["README.rst", "CHANGELOG.rst", "CONTRIBUTING.rst"])
def test_readme_renders_without_warnings(name: str) -> None:
    """README.rst and its two companions render as reStructuredText without a warning.

    docs/ uses Sphinx's roles, so `make docs` (sphinx-build -W) checks those pages.
    """
    docutils.core.publish_doctree(
        (ROOT / name).read_text(encoding="utf-8"),
        settings_overrides={"halt_level": docutils.utils.Reporter.WARNING_LEVEL, "report_level": 5},
    )


def test_readme_is_a_short_guide() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_LINES


def test_readme_links_only_pages_that_exist() -> None:
    """Every `text <path>`_ link of the README names a file of the checkout."""
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"`[^`<]+<([^>:]+)>`_", text)
    assert targets
    assert [target for target in targets if not (ROOT / target).is_file()] == []


def test_every_docs_page_is_in_the_table_of_contents() -> None:
    index = (DOCS / "index.rst").read_text(encoding="utf-8")
    pages = {path.stem for path in DOCS.glob("*.rst")} - {"index"}
    assert pages
    assert sorted(page for page in pages if not re.search(rf"^\s+{page}$", index, re.M)) == []


def test_pre_commit_pins_the_ruff_of_make_lint() -> None:
    """.pre-commit-config.yaml runs the ruff version setup.cfg's dev extra installs."""
    pinned = re.search(r"^\s*ruff==(\S+)$", (ROOT / "setup.cfg").read_text(), re.M)
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    (ruff,) = [repo for repo in hooks["repos"] if repo["repo"].endswith("/ruff-pre-commit")]
    assert pinned is not None
    assert ruff["rev"] == f"v{pinned.group(1)}"
    assert {hook["id"] for hook in ruff["hooks"]} == {"ruff-check", "ruff-format"}


def test_the_docs_document_every_setting() -> None:
    """Each setting has a row somewhere in README.rst or docs/ (docs/configuration.rst today)."""
    text = all_docs()
    missing = [name for name in config.SETTINGS if f"``{name}``" not in text]
    assert not missing


def test_the_configuration_page_has_a_row_for_each_of_gunicorns_settings() -> None:
    """Each variable deploy/gunicorn.conf.py reads is a row of docs/configuration.rst's tables."""
    conf = (ROOT / "deploy" / "gunicorn.conf.py").read_text(encoding="utf-8")
    read = set(re.findall(r'_(?:env|count)\("([A-Z_]+)"', conf))
    assert {"WEB_CONCURRENCY", "PETSTORE_THREADS", "GUNICORN_TIMEOUT"} <= read
    page = (ROOT / "docs" / "configuration.rst").read_text(encoding="utf-8")
    rows = set(re.findall(r"^``([A-Z_]+)``  ", page, re.M))
    assert not read - rows


def test_readme_shows_the_two_commands_first() -> None:
    text = README.read_text(encoding="utf-8")
    first_section = text.index("\n---")
    assert text.index("make run") < text.index("\n---", first_section + 4)
    assert text.index("make test") < text.index("\n---", first_section + 4)


def test_the_deployment_shows_the_install_script_itself() -> None:
    """The install script is included from deploy/install.sh, so the docs cannot drift from it."""
    text = all_docs()
    assert ".. literalinclude:: ../deploy/install.sh" in text
    assert (ROOT / "deploy" / "install.sh").is_file()


def test_readme_layout_names_every_module() -> None:
    """Each module of the package, by its path or by its name on its folder's line."""
    text = README.read_text(encoding="utf-8")
    layout = text[text.index("\nLayout\n") :]
    package = ROOT / "petstore"
    missing = []
    for path in sorted(package.glob("**/*.py")):
        module = path.relative_to(ROOT).as_posix()
        folder = f"{path.parent.relative_to(ROOT).as_posix()}/"
        if path.name == "__init__.py" and path.parent != package:
            continue
        if module not in layout and not (folder in layout and path.name in layout):
            missing.append(module)
    assert not missing


def test_the_docs_name_only_make_targets_that_exist() -> None:
    """`make X` in the docs is a target of the Makefile; make's options go in VAR=value."""
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"``make ([a-z-]+)", all_docs()))
    assert named
    assert sorted(named - targets) == []
    assert re.findall(r"make \w+ --", all_docs()) == []


def test_the_docs_say_how_often_a_failed_storage_is_checked_again() -> None:
    """The Redis fallback as the code does it: checked again at a fixed interval, not backing off."""
    text = all_docs()
    assert f"at most once every {STORAGE_RECHECK_SECONDS:g} s" in text
    assert "1, 2, 4" not in text


def test_the_fault_table_names_every_fault_the_tests_inject() -> None:
    """Each fault tests/system/test_faults.py runs has a row in the docs' fault table."""
    source = (ROOT / "tests" / "system" / "test_faults.py").read_text(encoding="utf-8")
    faults = re.findall(r'run_fault\(\s*\w+,\s*"([^"]+)"', source)
    assert faults
    text = all_docs()
    assert [fault for fault in faults if f"   * - {fault}\n" not in text] == []


def session(block: str | None = None) -> Iterator[tuple[str, str]]:
    """The shell session of a text (the README's by default): (command, its output as shown),
    continuation lines joined; only the indented lines of its literal blocks count."""
    if block is None:
        text = README.read_text(encoding="utf-8")
        block = text[text.index(".. session-start") : text.index(".. session-end")]
    literal = block[block.index("\n    $ ") + 1 :].rstrip()
    lines = [
        line.removeprefix("    ")
        for line in literal.splitlines()
        if line.startswith("    ") or not line.strip()
    ]
    command: str | None = None
    output: list[str] = []
    for line in lines:
        if line.startswith("$ "):
            if command is not None:
                yield command, "\n".join(output).rstrip("\n")
            command, output = line[2:], []
        elif command is not None and command.endswith("\\"):
            command = command[:-1] + line.strip()
        else:
            output.append(line)
    if command is not None:
        yield command, "\n".join(output).rstrip("\n")


def replay(client: FlaskClient, key: str, command: str, variable: str = "$KEY") -> str:
    """What `curl` prints for this command, asked of the app through the test client."""
    words = [word.replace(variable, key) for word in shlex.split(command, comments=True)]
    assert words[0] == "curl", command
    flags, headers, data, url = "", {}, None, None
    rest = iter(words[1:])
    for word in rest:
        if word == "-H":
            name, _, value = next(rest).partition(": ")
            headers[name] = value
        elif word == "-d":
            data = next(rest)
        elif word.startswith("-"):
            flags += word[1:]
        else:
            url = urlsplit(word)
    assert url is not None and set(flags) <= {"s", "i"}, command
    path = url.path + (f"?{url.query}" if url.query else "")
    method = "POST" if data is not None else "GET"
    response = client.open(path, method=method, headers=headers, data=data)
    body = response.get_data(as_text=True)
    if "i" not in flags:
        return body
    head = [f"HTTP/1.1 {response.status}"]
    head += [f"{name}: {value}" for name, value in response.headers.items()]
    return "\n".join([*head, "", body])


def comparable(output: str) -> str:
    """The output without gunicorn's own headers, its volatile values replaced by their names."""
    lines = [line for line in output.splitlines() if not line.startswith(SERVER_HEADERS)]
    text = "\n".join(lines)
    for pattern, name in VOLATILE:
        text = pattern.sub(name, text)
    return text


def test_readme_session_is_what_the_service_answers(client: FlaskClient, api_key: str) -> None:
    """Replayed on a fresh database with a new free key: the same statuses, headers and bodies."""
    steps = list(session())
    assert steps[0][0].startswith("KEY=ps_")
    curls = [(command, output) for command, output in steps if command.startswith("curl ")]
    assert len(curls) == len(steps) - 1
    for command, shown in curls:
        assert comparable(replay(client, api_key, command)) == comparable(shown), command
        if " -si " in command:
            assert [line.split(":")[0] for line in shown.splitlines()[1:4]] == list(
                SERVER_HEADERS
            ), "gunicorn's own headers come first"


def test_the_ban_examples_are_what_the_service_answers(
    client: FlaskClient, issue_key: Callable[..., str], database_url: str, tmp_path: Path
) -> None:
    """docs/usage.rst's 429s, ban, /v1/rate_limit and `petstore bans`, replayed in their order
    with the key they create (id 2, after make run's key 1), requests left out of the text sent
    where the text says: the first request (a 200), then the 429s before the ninth."""
    text = (DOCS / "usage.rst").read_text(encoding="utf-8")
    part = text[text.index("The examples below use a key allowed") : text.index("And with its")]
    steps = list(session(part))
    issue_key("free")
    created, variable = steps[0], steps[1][0]
    assert created[0].startswith(".venv/bin/petstore keys create") and variable.startswith("BATCH=")
    runner = CliRunner()
    environ = {"DATABASE_URL": database_url, "PETSTORE_VAR_DIR": str(tmp_path)}
    made = runner.invoke(main, shlex.split(created[0])[1:], env=environ)
    assert comparable(made.stdout) == comparable(created[1])
    key = made.stdout.splitlines()[-1]
    unshown = {2: 1, 3: 7}  # before the first curl shown, a 200; before the ninth 429, seven more
    for number, (command, shown) in enumerate(steps[2:], start=2):
        for _ in range(unshown.get(number, 0)):
            client.get("/v1/pets", headers={"Authorization": f"Bearer {key}"})
        if command.startswith("curl "):
            answered = replay(client, key, command, "$BATCH")
        else:
            assert command.startswith(".venv/bin/petstore "), command
            answered = runner.invoke(main, shlex.split(command)[1:], env=environ).stdout.rstrip()
            # A command's change reaches the service within its key cache's bound: let it pass.
            pass_key_cache_bound(client.application)
        assert comparable(answered) == comparable(shown), command


# A pointer from code to the manual: `README.rst, "Heading"` or `docs/page.rst, "Heading"`, the
# quoted heading possibly wrapped onto the next comment line.
POINTER = re.compile(r'\b(README(?:\.rst)?|docs/[\w/]+\.rst),\s*"([^"]+)"')
# A pointer that names a page and then no quoted heading: `(README, PgBouncer)`.
LOOSE_POINTER = re.compile(r'\((?:see )?(?:README(?:\.rst)?|docs/[\w/]+\.rst), (?!")')
HEADING = re.compile(r"^(\S[^\n]*)\n([=\-~^\"'`#*+])\2*$", re.M)
WRAP = re.compile(r"\s*\n\s*(?:#+|;+)?\s*")


def headings(text: str) -> set[str]:
    """The section titles of a reStructuredText page, without their inline markup."""
    return {
        title.replace("``", "")
        for title, underline in (
            (m.group(1), m.group(0).split("\n")[1]) for m in HEADING.finditer(text)
        )
        if len(underline) >= len(title)
    }


def code_files() -> Iterator[Path]:
    """The repository's code, deploy/ and .ci/ files: the places that point a reader at the manual."""
    for top in ("petstore", "deploy", ".ci", "bench", "tests"):
        for path in sorted((ROOT / top).rglob("*")):
            # This file's own examples are not pointers.
            skipped = "__pycache__" in path.parts or path == Path(__file__).resolve()
            if path.is_file() and not skipped and path.suffix != ".rst":
                yield path
    yield from (ROOT / "wsgi.py", ROOT / "Makefile", ROOT / "setup.cfg")


def test_every_pointer_to_the_manual_names_a_heading_that_exists() -> None:
    """A comment saying (docs/deploying.rst, "TLS") names a page and one of its headings."""
    titles = {path.relative_to(ROOT).as_posix(): headings(text) for path, text in manual().items()}
    titles["README"] = titles["README.rst"]
    pointers, loose = [], []
    for path in code_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        where = path.relative_to(ROOT).as_posix()
        for match in POINTER.finditer(text):
            pointers.append((where, match.group(1), WRAP.sub(" ", match.group(2))))
        loose += [(where, match.group(0)) for match in LOOSE_POINTER.finditer(text)]
    assert len(pointers) >= 10
    assert [p for p in pointers if p[2] not in titles.get(p[1], set())] == []
    assert loose == []


def test_every_code_block_names_its_language() -> None:
    """No bare `::` literal block in the README or the manual: each is a code-block with its
    language (console, bash, nginx, text...), so the manual highlights it as that."""
    bare = [
        (path.name, number)
        for path, text in manual().items()
        for number, line in enumerate(text.splitlines(), 1)
        if line.rstrip().endswith("::") and not line.lstrip().startswith("..")
    ]
    unnamed = re.findall(r"^\s*\.\. (?:code-block|code|sourcecode)::\s*$", all_docs(), re.M)
    assert bare == []
    assert unnamed == []


class OnTheDocsDay(datetime):
    """datetime whose now() is in docs/usage.rst's "today", 26 November 2026 (UTC)."""

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> datetime:
        """18:00 UTC that day (the view asks for UTC)."""
        return datetime(2026, 11, 26, 18, tzinfo=UTC)


def test_the_usage_examples_are_what_the_service_answers(
    client: FlaskClient, api_key: str, conn: db.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/usage.rst's GET /v1/usage, replayed for make run's key (id 1) with the counts it shows,
    on the day it shows: the day before's counts are left out of the default range, today."""
    text = (DOCS / "usage.rst").read_text(encoding="utf-8")
    part = text[text.index("\nUsage per key\n") : text.index("Counting costs a request")]
    monkeypatch.setattr(usage_view, "datetime", OnTheDocsDay)
    hour = datetime(2026, 11, 25, 14, tzinfo=UTC)
    usage_sql.add_usage(
        conn,
        [
            (1, hour, 120, 2, 8, 0),
            (1, hour.replace(day=26, hour=9), 29, 0, 0, 1),
            (1, hour.replace(day=26, hour=17), 11, 0, 0, 0),
        ],
    )
    steps = list(session(part))
    assert len(steps) == 4
    for command, shown in steps:
        assert comparable(replay(client, api_key, command)) == comparable(shown), command
