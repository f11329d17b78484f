"""The documentation site as a reader sees it, built from mkdocs.yml.

Built once with `mkdocs build --strict` into a temporary directory; then:
every docs page is in the nav, every page has a table of contents, code is
highlighted, docstring examples render as code blocks, and no docstring's
`**` (a power, in code or math) renders as bold (pages may bold words).
"""

import glob
import html
import os
import re
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(
  os.path.relpath(p, os.path.join(ROOT, "docs"))
  for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  out = tmp_path_factory.mktemp("site")
  build = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
  )
  assert build.returncode == 0, build.stdout + build.stderr
  return out


def _html(site, page):
  name = page[: -len(".md")]
  path = "index.html" if name == "index" else os.path.join(name, "index.html")
  with open(os.path.join(site, path)) as f:
    return f.read()


def _nav_pages(entries):
  for e in entries:
    value = next(iter(e.values())) if isinstance(e, dict) else e
    if isinstance(value, list):
      yield from _nav_pages(value)
    else:
      yield value


def test_every_docs_page_is_in_the_nav_once():
  with open(os.path.join(ROOT, "mkdocs.yml")) as f:
    nav = list(_nav_pages(yaml.safe_load(f)["nav"]))
  missing = [p for p in PAGES if p not in nav]
  assert not missing, (
    f"docs/{', docs/'.join(missing)} not in mkdocs.yml's nav: add each "
    "under its section (start, the library, the studies, running at "
    "scale, reference)"
  )
  assert sorted(nav) == PAGES, "nav names a page twice or one not in docs/"


def test_the_home_page_links_every_page():
  with open(os.path.join(ROOT, "docs", "index.md")) as f:
    linked = set(re.findall(r"\]\(([\w/]+\.md)[)#]", f.read()))
  missing = sorted(set(PAGES) - linked - {"index.md"})
  assert not missing, f"docs/index.md does not link {missing}"


def _toc_links(page_html):
  """Links of the page's own table of contents (the theme's secondary nav)."""
  start = page_html.find('aria-label="Table of contents"')
  if start < 0:
    return []
  end = page_html.find('<div class="md-content"', start)
  return re.findall(r'class="md-nav__link"', page_html[start:end])


@pytest.mark.parametrize("page", PAGES)
def test_every_page_has_a_table_of_contents(site, page):
  assert _toc_links(_html(site, page)), (
    f"docs/{page} has no section headings (##), so its table of contents "
    "is empty"
  )


def test_code_blocks_are_highlighted(site):
  page = _html(site, "formats.md")
  assert '<span class="kn">import</span>' in page  # a ```python block
  api = _html(site, "api.md")
  assert '<span class="gp">&gt;&gt;&gt; </span>' in api  # a docstring one


def _prose(page_html):
  """The page without its code: what Markdown rendered as text."""
  text = re.sub(r"<pre.*?</pre>", "", page_html, flags=re.S)
  return re.sub(r"<code.*?</code>", "", text, flags=re.S)


def _docstrings(page_html):
  """The rendered docstrings of a page (mkdocstrings' objects), without
  their code; empty where the page has none."""
  start = page_html.find('<div class="doc doc-object')
  if start < 0:
    return ""
  return _prose(page_html[start : page_html.find("</article>", start)])


@pytest.mark.parametrize("page", PAGES)
def test_docstring_examples_render_as_code(site, page):
  """`>>>` lines outside a code block render as text, or, at a line's
  start, as nested quotes run together into one paragraph."""
  page_html = _html(site, page)
  prose = _prose(page_html)
  where = [m.start() for m in re.finditer("&gt;&gt;&gt;", prose)]
  context = [html.unescape(prose[max(0, i - 80) : i + 80]) for i in where]
  assert not where, f"'>>>' rendered as text in docs/{page}: {context}"
  quoted = _docstrings(page_html).count("<blockquote>")
  assert not quoted, f"{quoted} docstring lines rendered as quotes in {page}"


# `<strong>` right after a digit, letter or bracket, or holding a number, a
# sign or a parenthesis first: a `**` of a power, not a bold word.
POWER = re.compile(r"(?<=[\w)\]])<strong>|<strong>(?=[-+(\d])")


def test_power_detector_tells_powers_from_bold_words():
  assert POWER.search("s * {-(2<strong>(K-1)-1), ..., 2</strong>(K-1)-1}")
  assert POWER.search("a multiple of 2<strong>-32, at most 2</strong>-32")
  assert not POWER.search("is <strong>erased</strong> (u != 0)")


def test_the_api_reference_renders_docstrings(site):
  assert len(_docstrings(_html(site, "api.md"))) > 10_000


@pytest.mark.parametrize("page", PAGES)
def test_no_power_in_a_docstring_renders_as_bold(site, page):
  text = _docstrings(_html(site, page))
  hits = [
    html.unescape(text[max(0, m.start() - 60) : m.start() + 60])
    for m in POWER.finditer(text)
  ]
  assert not hits, (
    f"'**' rendered as bold in a docstring on docs/{page} (put code and "
    f"math in backticks): {hits}"
  )


# A Returns / Yields entry whose wrapped lines are not indented past its
# first line: griffe reads each such line as another return value, and the
# reference shows one sentence as a table of several. A Raises line that is
# not `Error: why` (a wrapped line), or two errors on one line, likewise.
_SECTION = re.compile(r"^(\s*)(Returns|Yields|Raises):\s*$")
_NAMED = re.compile(r"^\w[\w.]*( \([^)]*\))?:(\s|$)")  # `name (type): ...`
_ERROR = re.compile(r"^[A-Z][\w.]*:(\s|$)")  # `ValueError: ...`
_TWO_ERRORS = re.compile(r"[.;]\s+[A-Z]\w*(Error|Exception|Warning):")


def section_fragments(doc: str) -> list[str]:
  """Lines of a Google-style docstring's Returns, Yields and Raises sections
  that griffe would read as an entry of their own but that continue the
  previous one (or that hold two entries)."""
  lines, out, i = doc.splitlines(), [], 0
  while i < len(lines):
    m = _SECTION.match(lines[i])
    i += 1
    if not m:
      continue
    head, kind, base, first = len(m.group(1)), m.group(2), None, True
    while i < len(lines):
      text = lines[i].strip()
      indent = len(lines[i]) - len(lines[i].lstrip())
      if text and indent <= head:
        break
      i += 1
      if not text:
        continue
      base = indent if base is None else base
      if kind == "Raises" and _TWO_ERRORS.search(text):
        out.append(f"{kind}: {text}")
      elif indent == base:
        entry = _ERROR if kind == "Raises" else _NAMED
        if (kind == "Raises" or not first) and not entry.match(text):
          out.append(f"{kind}: {text}")
        first = False
  return out


def test_section_fragments_tells_wrapped_lines_from_entries():
  wrapped = "Returns:\n  The array, in the carrier dtype or\n  `dtype`.\n"
  assert section_fragments(wrapped) == ["Returns: `dtype`."]
  ok = "Returns:\n  The array, in the carrier dtype or\n    `dtype`.\n"
  assert section_fragments(ok) == []
  named = "Returns:\n  loss: the loss.\n  aux (dict): the rest,\n    by name.\n"
  assert section_fragments(named) == []
  merged = "Raises:\n  TypeError: non-float input. ValueError: bad format.\n"
  assert len(section_fragments(merged)) == 1
  raises = "Raises:\n  ValueError: a bad\n    format.\n  TypeError: x.\n\nMore."
  assert section_fragments(raises) == []
  assert section_fragments("Raises:\n  ValueError: a bad\n  format.\n")


def _public(obj):
  """The public objects below `obj` that the API reference renders."""
  for name, member in obj.members.items():
    if member.is_alias or name.startswith("_"):
      continue
    yield member
    if member.is_module or member.is_class:
      yield from _public(member)


def test_returns_and_raises_entries_are_whole_sentences():
  import griffe

  package = griffe.load("lowprec", search_paths=[ROOT])
  bad = [
    f"{obj.relative_filepath} {obj.path}: {line}"
    for obj in [package, *_public(package)]
    if obj.docstring is not None
    for line in section_fragments(obj.docstring.value)
  ]
  assert not bad, (
    "wrapped lines of a Returns/Raises entry must be indented past its "
    "first line (one error per line in Raises):\n" + "\n".join(bad)
  )
