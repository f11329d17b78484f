"""A griffe extension for the API reference: `Example:` reads as `Examples:`.

Google-style docstrings here head their doctest-style examples `Example:`;
griffe parses only `Examples:` as an examples section (whose `>>>` lines it
renders as code) and turns `Example:` into an admonition whose `>>>` lines
Markdown renders as nested quotes, run together. Loaded by mkdocs.yml.
"""

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.M)


class ExampleSections(griffe.Extension):
  def on_object(self, *, obj, **kwargs):
    del kwargs
    if obj.docstring is not None:
      obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
