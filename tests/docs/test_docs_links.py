"""The docs stand alone: every relative link in README.md and docs/ resolves to a file inside the repository
(and every #anchor to a heading), no absolute filesystem path and no path leading out of the repository
appears in them, and the README lists every document under docs/."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md"] + list((ROOT / "docs").glob("*.md")))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# an absolute path: "/" starting a token (not inside a URL or a word like o/dq) followed by a path component
# and a further "/" (/work/..., /tmp/x/..., /home/...), or a home-relative or Windows drive path
ABS_PATH = re.compile(r"(?<![\w.:/\]\)>*-])/(?:[A-Za-z0-9_.+-]+/)+[A-Za-z0-9_.+-]*|~/[A-Za-z0-9_.-]+|"
                      r"\b[A-Z]:\\\\[A-Za-z]")
PARENT_PATH = re.compile(r"(?:^|[\s`(\"'])((?:\.\./)+[^\s`)\"']*)")
CODE_SPAN = re.compile(r"```.*?```", re.S)


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path):
    text = CODE_SPAN.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _links(path):
    text = CODE_SPAN.sub("", path.read_text())
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(doc):
    bad = []
    for target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... : not a file
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if ROOT not in dest.parents and dest != ROOT:
            bad.append(f"{target}: leads outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: {dest.relative_to(ROOT)} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{doc.relative_to(ROOT)}: " + "; ".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_absolute_or_outside_paths(doc):
    text = doc.read_text()
    found = [m.group(0) for m in ABS_PATH.finditer(text)]
    for m in PARENT_PATH.finditer(text):
        dest = (doc.parent / m.group(1)).resolve()
        if ROOT not in dest.parents or not dest.exists():
            found.append(m.group(1))
    assert not found, f"{doc.relative_to(ROOT)} names paths outside the repository: {found}"


def test_readme_lists_every_doc():
    readme = (ROOT / "README.md").read_text()
    # the "## Documents" section, one line per document (a link elsewhere in README does not count)
    section = readme.split("\n## Documents\n", 1)[1].split("\n## ", 1)[0]
    linked = {(ROOT / m.group(1).partition("#")[0]).resolve() for m in LINK.finditer(section)}
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"
    assert "docs/" in readme


def test_the_checks_catch_what_they_are_for(tmp_path):
    # the patterns themselves: an absolute path is caught, URLs, fractions and shapes are not
    assert ABS_PATH.search("see /work/shared/docs/notes.md") and ABS_PATH.search("mkdir -p /tmp/conf/sdk")
    assert not ABS_PATH.search("https://github.com/aws-neuron/nki-library and o/dq, dk/dv, [b, h, d/2]")
    assert PARENT_PATH.search("the method of `../shared/seeds/x.txt`")
    assert PARENT_PATH.search("(../README.md)").group(1) == "../README.md"
    assert _slug("What the model leaves out") == "what-the-model-leaves-out"
    assert _slug("## `harness_report.json` (schema version 2)".lstrip("# ")) == "harness_reportjson-schema-version-2"


# an issue number a reader of the repository cannot look up: "#13", "issue 16", "issue-14d", "Issue #19"
ISSUE_REF = re.compile(r"(?:^|[^&\w/\]])#\d+\b|\bissues?[ -]#?\d+\w*|\bissue[ -]?#", re.I)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_numbers(doc):
    found = [m.group(0).strip() for m in ISSUE_REF.finditer(doc.read_text())]
    assert not found, f"{doc.relative_to(ROOT)} cites issue numbers: {found} (say what the thing is instead)"


def test_the_issue_pattern_catches_what_it_is_for():
    for text in ("the variants of issue #14", "(#13)", "issue 16's planted bug", "issue-14d", "Issue #19 bug 1",
                 "#9 in the list"):
        assert ISSUE_REF.search(text), text
    for text in ("[link](file.md#section-2)", "&#39;", "x#1", "a tissue 3", "sha256[:12]", "issues remain"):
        assert not ISSUE_REF.search(text), text


def test_every_script_command_names_an_existing_script_and_subcommand():
    """Each ``python scripts/X.py [subcommand]`` in the docs names a script that exists and, for a script with
    subcommands, one of its subcommands (the table of replaced scripts in performance.md names the old files
    without ``python``)."""
    import ast
    bad = []
    for doc in DOCS:
        for m in re.finditer(r"python (scripts/[\w-]+\.py)(?: ([a-z][\w-]*))?", doc.read_text()):
            script = ROOT / m.group(1)
            if not script.is_file():
                bad.append(f"{doc.name}: {m.group(0)}: no such script")
                continue
            text = script.read_text()
            if m.group(2) and "add_subparsers" in text:
                names = {n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant)}
                if m.group(2) not in names:
                    bad.append(f"{doc.name}: {m.group(0)}: no subcommand {m.group(2)}")
    assert not bad, bad


# a file of this repository named in prose: a path under one of its top-level folders with a file suffix
REPO_PATH = re.compile(r"(?<![\w/.-])((?:tests|nki_attn|scripts|golden|reports|docs)/[\w./-]*"
                       r"\.(?:py|md|json|png|txt|toml))")
# names that are meant to be absent: the scripts the two figure entry points replaced (performance.md's table
# "The scripts these replace"), the merged tolerance document, and a file of FlashAttention's public repository
NOT_OURS = {
    "docs/performance.md": {"scripts/bench_compile.py", "scripts/bench_frontend_overhead.py",
                            "scripts/bench_sim_overhead.py", "scripts/bench_modeled_util.py",
                            "scripts/dropout_cost.py", "scripts/dropout_stats.py", "scripts/blas_orders.py",
                            "scripts/planted_bugs.py", "scripts/fwd_figures.py", "scripts/bwd_figures.py",
                            "scripts/ring_figures.py", "scripts/make_validation_note.py",
                            "scripts/fa_reference_check.py", "scripts/fwd_variant_costs.py",
                            "scripts/bwd_variant_cost.py", "scripts/variant_costs.py", "scripts/bwd_ablation.py",
                            "docs/tolerances.md"},
    "docs/validation.md": {"tests/test_flash_attn.py"},
}


def _missing_repo_paths(doc_name, text):
    allowed = NOT_OURS.get(doc_name, set())
    return sorted({m.group(1) for m in REPO_PATH.finditer(text)
                   if m.group(1) not in allowed and not (ROOT / m.group(1)).exists()})


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_repository_files_exist(doc):
    """A test file, module or script the prose names (outside links) exists: a restructuring that moves tests
    must move their description too."""
    name = str(doc.relative_to(ROOT))
    missing = _missing_repo_paths(name, doc.read_text())
    assert not missing, f"{name} names files that do not exist: {missing}"


def test_the_repository_path_check_catches_what_it_is_for():
    assert _missing_repo_paths("docs/x.md", "see `tests/kernels/test_gone.py` (83 tests)") == \
        ["tests/kernels/test_gone.py"]
    assert _missing_repo_paths("docs/x.md", "see tests/kernels/test_matrix.py and a/tests/foo.py") == []
    assert _missing_repo_paths("docs/performance.md", "| `scripts/bwd_ablation.py` |") == []
