"""Tensor groups: parameters named by what they are, from their paths.

A recipe that suits the MLP's matrices may not suit the norm gains: their
updates sit differently against a grid. Groups name the parameters by
their role, from their "/"-joined paths (`lowprec.engine.rules.path_name`), with
ordered `(name, regex)` pairs: a parameter belongs to the first group whose
regex matches its whole path (`re.fullmatch`). `DEFAULT_GROUPS` covers the
decoders of Flax linen, Flax NNX, Equinox and plain-JAX code under common
names; pass your own pairs where your names differ.

`labels(groups)` is the labelling function `optax.multi_transform` takes,
so that each group gets its own write-back and state store in one chain:

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.multi_transform(
            {"embeddings": ..., "attention": ..., "mlp": ..., ...},
            lowprec.groups.labels(),
        ),
    )

Telemetry of such a chain is keyed `<group>/<key>` (`lowprec.telemetry`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from lowprec.engine.rules import is_array, path_name

# name -> regex over the whole path; the first match wins. Biases include
# the norms' biases; "norms" holds their gains (scales).
DEFAULT_GROUPS: tuple[tuple[str, str], ...] = (
  ("embeddings", r"(.*/)?(wte|wpe|tok_embeddings|embed\w*|pos_emb\w*)(/.*)?"),
  ("norms", r".*(norm_scale|(norm|ln)[^/]*/(scale|weight|gain))"),
  ("biases", r".*bias"),
  ("attention", r".*(attn|attention)[^/]*/.*"),
  ("mlp", r".*(mlp|ffn|feed_forward)[^/]*/.*"),
  ("other", r".*"),
)


def as_groups(groups=None) -> tuple[tuple[str, re.Pattern], ...]:
  """`groups` (pairs, a dict, or "name=regex" strings) as compiled pairs.

  Raises:
    ValueError: a name that is not an identifier or appears twice, a
      string without "=", or a regex that does not compile.
  """
  if groups is None:
    groups = DEFAULT_GROUPS
  if isinstance(groups, Mapping):
    groups = tuple(groups.items())
  out, seen = [], set()
  for entry in groups:
    if isinstance(entry, str):
      name, sep, regex = entry.partition("=")
      if not sep:
        raise ValueError(
          f"group {entry!r} is not 'name=regex', e.g. "
          "'embeddings=(.*/)?(wte|wpe)(/.*)?'"
        )
    else:
      name, regex = entry
    name = name.strip()
    if not name.isidentifier() or name in seen:
      raise ValueError(
        f"group name {name!r} must be an identifier, each given once "
        f"(groups so far: {sorted(seen)})"
      )
    seen.add(name)
    if isinstance(regex, re.Pattern):
      out.append((name, regex))
      continue
    try:
      out.append((name, re.compile(regex.strip())))
    except re.error as e:
      raise ValueError(f"group {name!r}: regex {regex!r}: {e}") from None
  return tuple(out)


def group_of(name: str, groups=None) -> str:
  """The group of the parameter path `name` (first full match).

  Raises:
    ValueError: no group matches; add a catch-all such as ("other", ".*").
  """
  for group, regex in as_groups(groups):
    if regex.fullmatch(name):
      return group
  raise ValueError(
    f"parameter {name!r} is in no group; add a catch-all group, e.g. "
    "('other', '.*'), or a regex that matches it"
  )


def labels(groups=None) -> Callable[[Any], Any]:
  """`params -> pytree of group names`: the `labels` of
  `optax.multi_transform`, for any pytree of parameters (Flax NNX state,
  linen variables, Equinox models filtered to arrays, plain dicts).

  Example:
    >>> import jax.numpy as jnp
    >>> params = {"wte": jnp.zeros((8, 4)), "mlp": {"kernel": jnp.zeros(4)}}
    >>> labels()(params)
    {'mlp': {'kernel': 'mlp'}, 'wte': 'embeddings'}
  """
  compiled = as_groups(groups)

  def label(params):
    return jax.tree_util.tree_map_with_path(
      lambda path, _: group_of(path_name(path), compiled), params
    )

  return label


def leaf_sizes(params) -> dict[str, int]:
  """Number of elements per parameter path ("/"-joined), for any pytree
  of arrays or abstract arrays (`jax.eval_shape` outputs)."""
  return {
    path_name(path): int(np.prod(x.shape))
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
    if is_array(x) or hasattr(x, "shape")
  }


def sizes(params, groups=None) -> dict[str, int]:
  """Number of parameters (array elements) per group, in group order;
  groups without parameters are left out. Works on abstract arrays
  (`jax.eval_shape` outputs)."""
  compiled = as_groups(groups)
  out = dict.fromkeys((n for n, _ in compiled), 0)
  for name, n in leaf_sizes(params).items():
    out[group_of(name, compiled)] += n
  return {k: v for k, v in out.items() if v}


def members(names: Sequence[str], groups=None) -> dict[str, list[str]]:
  """Parameter paths by group, in group order (groups without any left
  out)."""
  compiled = as_groups(groups)
  out: dict[str, list[str]] = {n: [] for n, _ in compiled}
  for name in names:
    out[group_of(name, compiled)].append(name)
  return {k: v for k, v in out.items() if v}
