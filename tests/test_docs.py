"""The front door stays true: one version everywhere, every documentation page in the site's
navigation and every navigation entry a page, README short, and no words about how the project
was developed in what users and maintainers read. (CI builds the site with
``mkdocs build --strict``, which fails on a broken link or a docstring the reference cannot
render; ``tests/test_examples.py`` runs every example.)"""

import re
from pathlib import Path

import dist_ckpt

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_one_version_in_the_package_and_the_changelog():
    newest = re.search(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert newest is not None and newest.group(1) == dist_ckpt.__version__
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()  # taken from dist_ckpt.__version__


def test_every_page_is_in_the_navigation_and_every_entry_is_a_page():
    nav = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert nav == pages, (sorted(nav - pages), sorted(pages - nav))


def test_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    text = "\n".join(lines)
    for command in ('pip install "torch==2.13.0" -e . && dist-ckpt demo',
                    'pip install "torch==2.13.0" -e ".[all]" && python -m pytest'):
        assert command in text  # the two setup commands, unchanged
    assert 'python -m pytest' in (ROOT / ".ci" / "run").read_text()


# Built from parts, so that this file does not match itself.
_DEVELOPMENT_WORDS = re.compile("|".join([r"\bst" + r"op [0-9]+", "the run bef" + "ore", "this st" + "op",
                                          "NOT" + r"ES\.md"]), flags=re.I)


def test_no_words_about_how_the_project_was_developed():
    places = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CHANGELOG.md", *DOCS.rglob("*.md"),
              *(ROOT / "dist_ckpt").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
              *(ROOT / "benchmarks").rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in places
             for n, line in enumerate(p.read_text().splitlines(), 1) if _DEVELOPMENT_WORDS.search(line)]
    assert not found, "\n".join(found)


def test_readme_figures_are_those_of_the_generated_table():
    """README's "Why" quotes the benchmark table that ``run.py --write-docs`` and
    ``simulate_scale.py --write-docs`` write into docs/performance.md: every time, ratio and
    percentage it cites is in that page, so a new run's table cannot leave the README behind
    unnoticed."""
    readme = (ROOT / "README.md").read_text()
    why = readme[readme.index("## Why"):readme.index("## Setup")]
    page = (DOCS / "performance.md").read_text()
    cited = re.findall(r"(\d+(?:\.\d+)?)\s?(ms|s|x|%)(?![\w])", why)
    assert len(cited) >= 15, cited
    missing = []
    for number, unit in cited:
        forms = {"ms": [f"{float(number) / 1000:.3f}"], "s": [number], "x": [f"{number}x"], "%": [f"+{number}%"]}[unit]
        if not any(re.search(rf"(?<![\d.]){re.escape(form)}(?![\d])", page) for form in forms):
            missing.append(f"{number} {unit}")
    assert not missing, f"cited in README but not in docs/performance.md: {missing}"
    assert "torch >= 2.11" in readme and '"torch>=2.11"' in (ROOT / "pyproject.toml").read_text()
