"""What every study figure shares: arm styles, loss axes, saving, checks.

A study's figure is read at page width (`PAGE_PX`, the docs site's and the
README's column): `save` raises any text that would be smaller there than
`MIN_TEXT_PX` pixels, wraps long titles and axis labels to their panel,
lays the figure out with matplotlib's constrained layout, writes the PNG,
and warns (`IllegibleFigure`) of what `problems` still finds: text cut at
the figure's edge or on top of other text, a point outside its axes, a
panel with nothing drawn, a line hidden under an identical one.
"""

from __future__ import annotations

import os
import textwrap
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.text import Text  # noqa: E402

PAGE_PX = 760  # the width a figure is shown at, in pixels
MIN_TEXT_PX = 8  # the smallest text height legible at that width
# Arms are told apart by colour and by line style and marker, so that two
# arms with the same curve (a smoke run, a remedy that changes nothing)
# still show as two lines.
_LINES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


class IllegibleFigure(UserWarning):
  """A figure that would be hard or impossible to read at page width."""


def arm_style(i: int, points: int = 0) -> dict:
  """Line keywords of the `i`-th arm: colour, line style and markers, the
  lines and markers of earlier arms wider, so that an arm drawn over
  another with the same values leaves it showing around its own. Every
  point gets a marker when a curve has under 30 points (a single point
  shows); longer curves about 12, offset per arm."""
  step = max(points // 12, 1)
  every = 1 if points < 30 else (i * step // 5 % step, step)
  k = i % 5
  return {
    "color": f"C{i % 10}",
    "ls": _LINES[i % len(_LINES)],
    "marker": _MARKERS[i % len(_MARKERS)],
    "ms": 8.0 - 1.2 * k,
    "mfc": "none",
    "markevery": every,
    "lw": 2.4 - 0.35 * k,
  }


def loss_axes(ax, zoom: float = 0.3) -> None:
  """Limits that hold every point of the panel's curves; when their second
  half (in steps) spans under `zoom` of the whole range, an inset repeats
  that half, so that the late differences between arms show."""
  lines = [
    (
      line,
      np.asarray(line.get_xdata(), float),
      np.asarray(line.get_ydata(), float),
    )
    for line in ax.lines
    if line.get_transform() == ax.transData and np.size(line.get_xdata())
  ]
  ys = [y[np.isfinite(y)] for _, _, y in lines]
  ys = [y for y in ys if y.size]
  if not ys:
    return
  every = np.concatenate(ys)
  lo, hi = float(every.min()), float(every.max())
  ax.set_ylim(lo - 0.05 * (hi - lo or 1.0), hi + 0.05 * (hi - lo or 1.0))
  half = max(float(np.nanmax(x)) for _, x, _ in lines) / 2
  late = [y[(x >= half) & np.isfinite(y)] for _, x, y in lines]
  late = np.concatenate([y for y in late if y.size] or [np.zeros(0)])
  if late.size < 2 or hi <= lo or np.ptp(late) >= zoom * (hi - lo):
    return
  inset = ax.inset_axes([0.45, 0.42, 0.52, 0.5])
  for line, x, y in lines:
    keep = x >= half
    inset.plot(
      x[keep],
      y[keep],
      color=line.get_color(),
      ls=line.get_linestyle(),
      lw=line.get_linewidth(),
      marker=line.get_marker(),
      ms=line.get_markersize(),
      mfc="none",
    )
  pad = 0.08 * (np.ptp(late) or abs(late[0]) * 1e-3 or 1.0)
  inset.set_ylim(late.min() - pad, late.max() + pad)
  inset.set_title("second half", fontsize=8)
  inset.tick_params(labelsize=8)


def legend_outside(ax) -> None:
  """The legend to the right of the panel (many arms would cover it)."""
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))


def _tick_labels(ax):
  """(label, drawn) of every tick label of `ax`: drawn when its tick is
  inside the axis' view interval (matplotlib keeps the others unused)."""
  for axis in (ax.xaxis, ax.yaxis):
    lo, hi = sorted(axis.get_view_interval())
    span = 1e-9 * (abs(lo) + abs(hi))
    for tick in axis.get_major_ticks() + axis.get_minor_ticks():
      inside = lo - span <= tick.get_loc() <= hi + span
      for label in (tick.label1, tick.label2):
        yield label, inside and tick.get_visible() and ax.get_visible()


def _texts(fig) -> list[Text]:
  """Every drawn, non-empty text of the figure (titles, labels, ticks,
  legends, annotations)."""
  ticks = {
    id(label): drawn for ax in _axes(fig) for label, drawn in _tick_labels(ax)
  }
  out = []
  for t in fig.findobj(Text):
    if not t.get_visible() or not t.get_text().strip():
      continue
    if t.axes is not None and not t.axes.get_visible():
      continue
    if not ticks.get(id(t), True):
      continue
    out.append(t)
  return out


def _min_points(fig, dpi: float) -> float:
  """The smallest font size (points) that is `MIN_TEXT_PX` at page width."""
  px_per_inch = min(dpi, PAGE_PX / fig.get_figwidth())
  return MIN_TEXT_PX * 72 / px_per_inch


def _wrap(fig) -> None:
  """Titles and axis labels wrapped to their panel's width."""
  for ax in _axes(fig):
    box = ax.get_position()
    width_pt = box.width * fig.get_figwidth() * 72
    height_pt = box.height * fig.get_figheight() * 72
    for text, room in (
      (ax.title, width_pt),
      (ax.xaxis.label, width_pt),
      (ax.yaxis.label, height_pt),
    ):
      chars = max(int(room / (0.55 * text.get_fontsize())), 12)
      lines = text.get_text().split("\n")
      if any(len(s) > chars for s in lines):
        wrapped = [textwrap.fill(s, chars) for s in lines]
        text.set_text("\n".join(wrapped))


def _axes(fig):
  for ax in fig.axes:
    yield ax
    yield from ax.child_axes


def save(fig, path: str, dpi: int = 100) -> str:
  """Makes the figure legible at page width, writes it, closes it; warns
  (`IllegibleFigure`) of what is still hard to read. Returns `path`."""
  smallest = _min_points(fig, dpi)
  for ax in _axes(fig):
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
      sizes = [t.get_fontsize() for t in axis.get_ticklabels(which="both")]
      if sizes and min(sizes) < smallest:  # ticks made later follow too
        ax.tick_params(axis=name, which="both", labelsize=smallest)
  for t in _texts(fig):
    if t.get_fontsize() < smallest:
      t.set_fontsize(smallest)
  _wrap(fig)
  fig.set_layout_engine("constrained")
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=dpi)
  found = problems(fig, dpi)
  plt.close(fig)
  for p in found:
    warnings.warn(f"{os.path.basename(path)}: {p}", IllegibleFigure, 2)
  return path


def problems(fig, dpi: float | None = None) -> list[str]:
  """What makes a drawn figure hard to read at page width, one line each."""
  dpi = dpi or fig.dpi
  fig.canvas.draw()
  renderer = fig.canvas.get_renderer()
  px_per_point = min(dpi, PAGE_PX / fig.get_figwidth()) / 72
  out = []
  texts = _texts(fig)
  page = fig.bbox
  boxes = []
  for t in texts:
    box = t.get_window_extent(renderer)
    name = repr(t.get_text()[:40])
    px = t.get_fontsize() * px_per_point
    if px < MIN_TEXT_PX - 1e-6:
      out.append(f"text {name} is {px:.1f} px high at page width")
    if (
      box.x0 < page.x0 - 1
      or box.y0 < page.y0 - 1
      or box.x1 > page.x1 + 1
      or box.y1 > page.y1 + 1
    ):
      out.append(f"text {name} is cut at the figure's edge")
    boxes.append((t, box))
  out += _overlaps(boxes, _legend_texts(fig))
  for n, ax in enumerate(_axes(fig), start=1):
    out += [f"panel {n}: {p}" for p in _panel_problems(ax)]
  return out


def _legend_texts(fig) -> set[int]:
  legends = list(fig.legends) + [
    ax.get_legend() for ax in _axes(fig) if ax.get_legend() is not None
  ]
  return {id(t) for leg in legends for t in leg.get_texts()}


def _apart(a, b) -> bool:
  """Two texts turned by the same angle (tick labels at 45 degrees) whose
  lines do not meet, though their upright bounding boxes may."""
  angle = np.deg2rad(a.get_rotation())
  if angle % np.pi == 0 or a.get_rotation() != b.get_rotation():
    return False
  pa, pb = (t.get_transform().transform(t.get_position()) for t in (a, b))
  normal = np.array([-np.sin(angle), np.cos(angle)])
  lines = max(t.get_text().count("\n") + 1 for t in (a, b))
  height = lines * 1.2 * max(a.get_fontsize(), b.get_fontsize())
  height *= a.get_figure(root=True).dpi / 72
  return abs(float(np.dot(pb - pa, normal))) >= height


def _overlaps(boxes, legend_texts) -> list[str]:
  """Pairs of texts drawn on top of each other (a legend's own entries
  aside: the legend lays them out)."""
  out = []
  for i, (a, ba) in enumerate(boxes):
    for b, bb in boxes[i + 1 :]:
      if id(a) in legend_texts and id(b) in legend_texts:
        continue
      inter_w = min(ba.x1, bb.x1) - max(ba.x0, bb.x0)
      inter_h = min(ba.y1, bb.y1) - max(ba.y0, bb.y0)
      if inter_w > 1 and inter_h > 1 and not _apart(a, b):
        out.append(
          f"texts {a.get_text()[:30]!r} and {b.get_text()[:30]!r} overlap"
        )
  return out


def _data_points(ax):
  """(label, x, y) of every line and scatter drawn in data coordinates."""
  for line in ax.lines:
    if line.get_transform() != ax.transData or not line.get_visible():
      continue
    x = np.asarray(line.get_xdata(), float)
    y = np.asarray(line.get_ydata(), float)
    yield line, x, y
  for coll in ax.collections:
    if isinstance(coll, PathCollection) and coll.get_visible():
      pts = np.asarray(coll.get_offsets(), float).reshape(-1, 2)
      yield coll, pts[:, 0], pts[:, 1]


def _panel_problems(ax) -> list[str]:
  if not ax.get_visible():
    return []
  out, drawn = [], False
  (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
  tol_x, tol_y = 1e-9 * (abs(x0) + abs(x1)), 1e-9 * (abs(y0) + abs(y1))
  seen = []
  for artist, x, y in _data_points(ax):
    ok = np.isfinite(x) & np.isfinite(y)
    if not ok.any():
      continue
    drawn = True
    x, y = x[ok], y[ok]
    outside = (
      (x < x0 - tol_x) | (x > x1 + tol_x) | (y < y0 - tol_y) | (y > y1 + tol_y)
    )
    if outside.any():
      i = int(np.argmax(outside))
      out.append(
        f"{int(outside.sum())} point(s) outside the axes, e.g. "
        f"({x[i]:.4g}, {y[i]:.4g}) of {artist.get_label()!r}"
      )
    if hasattr(artist, "get_linestyle") and hasattr(artist, "get_marker"):
      key = (artist.get_linestyle(), artist.get_marker())
      for other, ox, oy, okey in seen:
        # Within a pixel or so of each other: the one below is not seen.
        if okey == key and ox.shape == x.shape and np.allclose(ox, x):
          if np.all(np.abs(oy - y) <= 0.003 * (y1 - y0)):
            out.append(
              f"line {other.get_label()!r} is hidden under "
              f"{artist.get_label()!r} (same values, same style)"
            )
      seen.append((artist, x, y, key))
  drawn = drawn or bool(ax.patches) or bool(ax.images) or bool(ax.texts)
  if not drawn:
    out.append("nothing drawn (drop the panel or say why it is empty)")
  return out
