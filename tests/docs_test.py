"""Every Python block in README.md and docs/*.md runs as pasted.

The convention the pages follow (docs/index.md states it for writers):

* A ```python block is run on its own, in a fresh namespace, as a reader
  would paste it into a new interpreter: it carries its own imports.
* If the next thing after it (blank lines aside) is a ```text block, what
  the Python block prints must equal that text (trailing spaces aside);
  otherwise it must print nothing, so that no output goes unshown.
* The line `<!-- docs: skip (reason) -->` just before a block leaves it out;
  the reason is required.
* Numbers are read as numbers: each printed number may differ from the
  page's by at most two units of the page's last shown digit (0.0031 for
  0.0033, 5.0e-04 for 4.8e-04, +0.9 for +0.8), since XLA:CPU gives other
  last bits on other CPUs (AVX-512 against AVX2) and a value near a
  rounding boundary prints one digit apart. Everything else must match
  exactly, and so must integers (counts).

Pages added to docs/ are picked up without listing them here.
"""

import contextlib
import dataclasses
import glob
import io
import os
import re

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [
  "README.md",
  *sorted(glob.glob("docs/**/*.md", root_dir=ROOT, recursive=True)),
]
_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
_SKIP = re.compile(r"^<!--\s*docs:\s*skip\s*\((.+)\)\s*-->$")


@dataclasses.dataclass(frozen=True)
class Block:
  lang: str
  line: int  # 1-based line of the opening fence
  body: str
  skip: str | None  # the reason, when marked to be skipped


@dataclasses.dataclass(frozen=True)
class Example:
  page: str
  line: int
  code: str
  expected: str  # "" when no output block follows
  skip: str | None


def parse_blocks(text: str) -> list[Block]:
  """The fenced blocks of a Markdown text, with what stands before each."""
  lines = text.splitlines()
  out, i, prev = [], 0, ""
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      if lines[i].strip():
        prev = lines[i].strip()
      i += 1
      continue
    start, body = i, []
    i += 1
    while i < len(lines) and lines[i].strip() != "```":
      body.append(lines[i])
      i += 1
    if i == len(lines):
      raise ValueError(f"line {start + 1}: a code block is never closed")
    skip = _SKIP.match(prev)
    out.append(
      Block(m.group(1), start + 1, "\n".join(body), skip and skip.group(1))
    )
    i += 1
    prev = "```"
  return out


def examples(page: str, text: str) -> list[Example]:
  """The Python blocks of a page, each with the output block after it."""
  blocks = parse_blocks(text)
  lines = text.splitlines()
  out = []
  for k, b in enumerate(blocks):
    if b.lang != "python":
      continue
    expected = ""
    nxt = blocks[k + 1] if k + 1 < len(blocks) else None
    if nxt is not None and nxt.lang == "text":
      end = b.line + b.body.count("\n") + 1  # 0-based index of the close
      if all(not x.strip() for x in lines[end + 1 : nxt.line - 1]):
        expected = nxt.body
    out.append(Example(page, b.line, b.body, expected, b.skip))
  return out


def run(example: Example) -> str:
  """Runs one block in a fresh namespace; returns what it printed."""
  code = compile(example.code, f"{example.page}:{example.line}", "exec")
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    exec(code, {"__name__": "__docs__"})
  return buf.getvalue()


def _normal(s: str) -> str:
  return "\n".join(x.rstrip() for x in s.strip("\n").splitlines())


# A decimal number with a fractional part and optional exponent.
_NUMBER = re.compile(r"[-+]?\d+\.(\d+)(?:[eE]([-+]?\d+))?")


def _close(got: str, want: str) -> bool:
  """Whether two numbers as printed agree within two units of `want`'s
  last shown digit."""
  m = _NUMBER.fullmatch(want)
  if not m or not _NUMBER.fullmatch(got):
    return got == want
  unit = 10.0 ** (-len(m.group(1)) + int(m.group(2) or 0))
  return abs(float(got) - float(want)) <= 2 * unit * (1 + 1e-9)


def same_output(got: str, want: str) -> bool:
  """`got` equals `want`, numbers with fractional digits compared by
  `_close` and everything else exactly."""
  g, w = _NUMBER.split(got), _NUMBER.split(want)
  gn, wn = (
    [m.group(0) for m in _NUMBER.finditer(got)],
    [m.group(0) for m in _NUMBER.finditer(want)],
  )
  # split() interleaves the groups; compare the text between numbers.
  text = lambda parts: parts[:: _NUMBER.groups + 1]  # noqa: E731
  return (
    text(g) == text(w)
    and len(gn) == len(wn)
    and all(_close(a, b) for a, b in zip(gn, wn, strict=True))
  )


def check(example: Example) -> None:
  """Raises AssertionError when the printed output differs from the shown,
  or when the block changed JAX's global settings."""
  before = dict(jax.config.values)
  got = _normal(run(example))
  # Blocks run in the test process: one that changed JAX's global settings
  # (x64, default device, ...) would change the tests that run after it.
  now = jax.config.values
  changed = sorted(k for k in now if before.get(k) != now[k])
  assert not changed, f"{example.page}:{example.line} changes {changed}"
  want = _normal(example.expected)
  where = f"{example.page}:{example.line}"
  if not want:
    assert not got, f"{where} prints output that the page does not show:\n{got}"
  assert same_output(got, want), (
    f"{where} printed\n{got}\n\nthe page shows\n{want}"
  )


def _all_examples() -> list[Example]:
  out = []
  for page in PAGES:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
      out += examples(page, f.read())
  return out


EXAMPLES = _all_examples()


@pytest.mark.parametrize(
  "example", EXAMPLES, ids=[f"{e.page}:{e.line}" for e in EXAMPLES]
)
def test_block_runs_as_pasted_and_prints_what_the_page_shows(example):
  if example.skip:
    pytest.skip(example.skip)
  check(example)


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
  """The link targets of a Markdown text that are paths, anchors dropped."""
  targets = (m.split("#")[0] for m in _LINK.findall(text))
  return [t for t in targets if t and "://" not in t and ":" not in t]


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_names_a_file_of_the_repository(page):
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    links = relative_links(f.read())
  here = os.path.dirname(os.path.join(ROOT, page))
  missing = [t for t in links if not os.path.exists(os.path.join(here, t))]
  assert not missing, f"{page} links to missing files: {missing}"


def test_relative_links_are_found():
  text = "[a](docs/a.md#x), [b](https://x.org/b.md), ![c](figures/c.png)"
  assert relative_links(text) == ["docs/a.md", "figures/c.png"]


def _prose_lines(text: str) -> list[str]:
  """The lines of a Markdown text outside its fenced code blocks."""
  out, fenced = [], False
  for line in text.splitlines():
    if line.startswith("```"):
      fenced = not fenced
    elif not fenced:
      out.append(line)
  return out


def heading_anchors(text: str) -> set[str]:
  """The anchors of a page's headings, as the site (Python-Markdown's toc)
  makes them, and the ids of its HTML anchors."""
  from markdown.extensions.toc import slugify

  out, seen = set(), {}
  for line in _prose_lines(text):
    m = re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
    if m:
      words = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
      slug = slugify(re.sub(r"[`*]", "", words), "-")
      n = seen.get(slug, 0)
      seen[slug] = n + 1
      out.add(slug if n == 0 else f"{slug}_{n}")
    out.update(re.findall(r'\bid="([^"]+)"', line))
  return out


@pytest.mark.parametrize("page", PAGES)
def test_every_anchor_link_names_a_heading_of_its_page(page):
  # mkdocs --strict reports a missing anchor only as INFO.
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    text = f.read()
  here = os.path.dirname(os.path.join(ROOT, page))
  broken = []
  for link in _LINK.findall("\n".join(_prose_lines(text))):
    target, _, anchor = link.partition("#")
    if not anchor or "://" in target or not (target or "#" in link):
      continue
    path = os.path.join(here, target) if target else os.path.join(ROOT, page)
    if not path.endswith(".md") or not os.path.exists(path):
      continue
    with open(path, encoding="utf-8") as f:
      if anchor not in heading_anchors(f.read()):
        broken.append(link)
  assert not broken, f"{page} links to headings that do not exist: {broken}"


def test_heading_anchors_are_the_sites():
  text = (
    "# Top\n\n## The grid (`freeze_grid`)\n\n```python\n# no\n```\n## A\n## A"
  )
  assert heading_anchors(text) == {"top", "the-grid-freeze_grid", "a", "a_1"}


def table_cells(row: str) -> list[str]:
  """The cells of a Markdown table row: split at `|` that is neither
  escaped nor inside backticks."""
  cells, cell, code, i = [], "", False, 0
  while i < len(row):
    c = row[i]
    if c == "\\" and i + 1 < len(row):
      cell += row[i : i + 2]
      i += 2
      continue
    if c == "`":
      code = not code
    if c == "|" and not code:
      cells.append(cell.strip())
      cell = ""
    else:
      cell += c
    i += 1
  cells.append(cell.strip())
  return cells[1:-1] if row.strip().startswith("|") else cells


@pytest.mark.parametrize("page", PAGES)
def test_every_table_row_has_its_headers_cells(page):
  # A `|` in a cell (`|predicted - nearest|`) adds a column: the table
  # then renders as raw text. Escape it as `\\|`.
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    lines = _prose_lines(f.read())
  bad = []
  for i, line in enumerate(lines[1:], start=1):
    if re.fullmatch(r"\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*", line):
      width = len(table_cells(lines[i - 1]))
      if len(table_cells(line)) != width:
        bad.append(lines[i - 1][:60])
      for row in lines[i + 1 :]:
        if not row.startswith("|"):
          break
        if len(table_cells(row)) != width:
          bad.append(row[:60])
  assert not bad, f"{page}: rows whose cells differ from the header: {bad}"


def test_table_cells_keep_escaped_pipes_and_code():
  assert table_cells("| a | \\|x\\| | `b|c` |") == ["a", "\\|x\\|", "`b|c`"]


STATUSES = ("reproduced", "partly", "not reproduced", "not covered")
BEYOND = "beyond the papers"  # a study that answers no claim of the papers


def _tables(text: str):
  """Each Markdown table of a text as (header cells, rows of cells)."""
  lines = _prose_lines(text)
  for i in range(1, len(lines)):
    if lines[i].startswith("|---") and lines[i - 1].startswith("|"):
      rows = []
      for row in lines[i + 1 :]:
        if not row.startswith("|"):
          break
        rows.append(table_cells(row))
      yield table_cells(lines[i - 1]), rows


def _names(cell: str) -> list[str]:
  return re.findall(r"`(\w+)`", cell)


def claims_statuses() -> dict[str, str]:
  """Each study's status from docs/claims.md: that of the claims whose
  study column names it, or partly where they differ; `BEYOND` for the
  studies of its table of questions beyond the papers."""
  with open(os.path.join(ROOT, "docs", "claims.md"), encoding="utf-8") as f:
    text = f.read()
  found: dict[str, set] = {}
  for head, rows in _tables(text):
    if head[0] == "question":
      for row in rows:
        for name in _names(row[head.index("study")]):
          found.setdefault(name, set()).add(BEYOND)
      continue
    status = head.index("status")
    for row in rows:
      assert row[status] in STATUSES, f"claims.md: status {row[status]!r}"
      names = _names(row[head.index("study")])
      assert names or row[status] == "not covered", (
        f"claims.md: a measured claim links no study: {row[0][:60]}"
      )
      for name in names:
        found.setdefault(name, set()).add(row[status])
  return {
    n: next(iter(s)) if len(s) == 1 else "partly" for n, s in found.items()
  }


def page_statuses(page: str, first: str) -> dict[str, str]:
  """Each study's status in the table of `page` whose first column is
  `first` and that has a status column."""
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    text = f.read()
  out = {}
  for head, rows in _tables(text):
    if head[0] == first and "status" in head:
      for row in rows:
        for name in _names(row[0]):
          out[name] = row[head.index("status")]
  return out


def test_claims_page_links_every_study_and_uses_its_four_statuses():
  from experiments.analysis import studies

  statuses = claims_statuses()
  assert set(statuses) == set(studies.names()) - {"smoke"}


@pytest.mark.parametrize("page", ["README.md", "docs/freeze_studies.md"])
def test_study_statuses_equal_the_claims_page(page):
  want = claims_statuses()
  got = page_statuses(page, "study")
  assert got, f"{page} has no table of studies with a status column"
  if page == "README.md":
    assert set(got) == set(want), "the README lists every study"
  wrong = {n: (s, want.get(n)) for n, s in got.items() if s != want.get(n)}
  assert not wrong, f"{page}: status (here, on claims.md) differs: {wrong}"


# A number in prose: a sign only where it does not join a range
# ("0.16-0.17" is 0.16 and 0.17), thousands separated by commas, no digit
# inside a name (e4m3, bf16, b2).
_PROSE_NUMBER = re.compile(
  r"(?<![\w.])([-+])?(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?:[eE]([-+]?\d+))?"
)


def prose_numbers(text: str) -> set[float]:
  """The numbers of a text as values: "+0.0730" and "0.073" are one;
  "+-0.06" is 0.06."""
  out = set()
  for m in _PROSE_NUMBER.finditer(text.replace("+-", "±")):
    digits = m.group(2).replace(",", "") + (m.group(3) or "")
    value = float(f"{digits}e{m.group(4) or 0}")
    out.add(-value if m.group(1) == "-" else value)
  return out


def test_prose_numbers_read_signs_ranges_and_names():
  text = "e4m3 at 3.08 bytes (-0.0056 [-0.0135, +0.0023]), +0.16-0.17, bf16"
  assert prose_numbers(text) == {3.08, -0.0056, -0.0135, 0.0023, 0.16, 0.17}
  assert prose_numbers("120,576 params, 1.5e-3, +-0.06, 95%, 3/4") == {
    120576,
    0.0015,
    0.06,
    95,
    3,
    4,
  }


def _study_row(page: str, study: str, first: str) -> str:
  """The text of the row of `page`'s table whose first column is `first`
  (or whose `study` column names `study`, for claims.md's questions)."""
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    text = f.read()
  rows = []
  for head, body in _tables(text):
    col = head.index("study") if head[0] == "question" else 0
    if head[0] != first:
      continue
    rows += [" | ".join(r) for r in body if _names(r[col]) == [study]]
  assert len(rows) == 1, f"{page}: {len(rows)} rows for {study}"
  return rows[0]


@pytest.mark.parametrize(
  "study", ["frontier", "frontier_confirm", "advise_check"]
)
def test_readme_frontier_row_states_only_the_claims_pages_numbers(study):
  # The README may state fewer numbers than claims.md, never other ones:
  # a number changed in one must be changed in the other.
  readme = _study_row("README.md", study, "study")
  claims = _study_row("docs/claims.md", study, "question")
  missing = sorted(prose_numbers(readme) - prose_numbers(claims))
  assert prose_numbers(readme), f"the README's {study} row states no number"
  assert not missing, (
    f"README's {study} row states numbers claims.md's does not: {missing}"
  )


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_stands_alone_with_a_caption(page):
  # A figure shares no line with another (side by side, each is shown at
  # a fraction of the page width, its text too small to read) and the
  # line after it is its caption, in italics: what it shows.
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    lines = _prose_lines(f.read())
  bad = []
  for i, line in enumerate(lines):
    figures = re.findall(r"!\[[^\]]*\]\([^)]*\.png\)", line)
    if not figures:
      continue
    caption = lines[i + 1] if i + 1 < len(lines) else ""
    if len(figures) > 1 or line.strip() != figures[0]:
      bad.append(f"{line[:50]}: not alone on its line")
    elif not caption.startswith("*") or caption.startswith("* "):
      bad.append(f"{line[:50]}: no caption on the next line")
  assert not bad, f"{page}: {bad}"


@pytest.mark.parametrize("page", [p for p in PAGES if p.startswith("docs/")])
def test_long_pages_have_sections(page):
  # The site's table of contents lists a page's `##` sections: a long page
  # needs at least two, and one per 100 lines.
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    lines = _prose_lines(f.read())
  total = len(lines)
  sections = sum(line.startswith("## ") for line in lines)
  if total > 60:
    assert sections >= max(2, total // 100), (page, total, sections)


def test_the_readme_and_every_topic_page_have_blocks_to_run():
  pages = {e.page for e in EXAMPLES}
  assert "README.md" in pages
  assert len(pages) >= 4, pages


# -------------------------------------------------- the runner itself


PAGE = """\
Intro.

```python
print(1 + 1)
```

```text
2
```

```python
x = 3
```

<!-- docs: skip (needs a GPU) -->
```python
raise RuntimeError
```

```bash
echo not python
```
"""


def test_parse_pairs_each_block_with_its_output_and_skip_marker():
  ex = examples("page.md", PAGE)
  assert [(e.line, e.expected, e.skip) for e in ex] == [
    (3, "2", None),
    (11, "", None),
    (16, "", "needs a GPU"),
  ]


def test_check_fails_on_wrong_missing_or_unshown_output():
  right = Example("p", 1, "print('a')\nprint('b ')", "a\nb", None)
  check(right)
  for bad in [
    Example("p", 1, "print('a')", "b", None),  # wrong output
    Example("p", 1, "pass", "a", None),  # shown, never printed
    Example("p", 1, "print('a')", "", None),  # printed, never shown
  ]:
    with pytest.raises(AssertionError):
      check(bad)


def test_each_block_gets_a_fresh_namespace():
  check(Example("p", 1, "x = 1", "", None))
  with pytest.raises(NameError):
    check(Example("p", 2, "print(x)", "1", None))


def test_a_block_that_changes_jax_settings_fails():
  code = "import jax\njax.config.update('jax_enable_x64', True)"
  try:
    with pytest.raises(AssertionError, match="jax_enable_x64"):
      check(Example("p", 1, code, "", None))
  finally:
    jax.config.update("jax_enable_x64", False)


def test_an_unclosed_block_is_an_error():
  with pytest.raises(ValueError, match="never closed"):
    parse_blocks("```python\nprint(1)\n")


@pytest.mark.parametrize(
  "got, want, same",
  [
    ("loss 0.0031, moved 66", "loss 0.0033, moved 66", True),
    ("loss 0.0030, moved 66", "loss 0.0033, moved 66", False),
    ("loss 0.0033, moved 65", "loss 0.0033, moved 66", False),
    ("bias +5.0e-04 z=+0.9", "bias +4.8e-04 z=+0.8", True),
    ("bias +5.1e-04", "bias +4.8e-04", False),
    ("bias +4.8e-03", "bias +4.8e-04", False),
    ("loss 0.0033 ok", "loss 0.0033 OK", False),
    ("a 1.5 b 2.5", "a 1.5 b", False),
  ],
  ids=["2-units", "3-units", "count", "exponent", "exp-3-units", "exp-off",
       "text", "extra-number"],
)  # fmt: skip
def test_numbers_may_differ_by_two_units_of_the_last_digit(got, want, same):
  assert same_output(got, want) is same
