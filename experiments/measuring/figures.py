"""Figures that stay readable whatever their labels.

A strategy name grows with its switches (``fsdp-mpi+forward_prefetch+backward_prefetch+async_reduce_scatter``):
written on one line, such a label takes most of a figure's width and pushes the title, the axis label and the
legend off its edges. The figures wrap long labels at their joints (``wrap``), lay themselves out with
matplotlib's constrained layout, and are written by ``save``, which names any text drawn outside the figure.
"""

import re
import sys
from pathlib import Path

def wrap(text: str, width: int, joints: str = "+, ") -> str:
    """`text` in lines of at most `width` characters, broken after any of `joints` (by default a '+', ',' or
    space: a strategy joins its switches with '+'); a piece longer than `width` keeps a line of its own.
    Line breaks already in `text` are kept."""
    joint = f"[{re.escape(joints)}]"
    pieces = re.compile(f"[^{re.escape(joints)}]*{joint}|[^{re.escape(joints)}]+$")  # each ends at a joint
    lines = []
    for paragraph in text.split("\n"):
        line = ""
        for piece in pieces.findall(paragraph):
            if line and len((line + piece).rstrip()) > width:
                lines.append(line.rstrip())
                line = piece
            else:
                line += piece
        lines.append(line.rstrip())
    return "\n".join(lines)


def outside_the_figure(figure) -> list[str]:
    """The texts drawn wholly or partly outside `figure` (with where they reach): none in a readable figure.
    Only texts that drawing the figure draws count (not, say, the labels of ticks beyond an axis's limits)."""
    from matplotlib.text import Text

    drawn = []
    draw = Text.draw

    def recording_draw(text, renderer):
        drawn.append(text)
        return draw(text, renderer)

    renderer = figure.canvas.get_renderer()
    Text.draw = recording_draw
    try:
        figure.draw(renderer)  # lays the figure out as saving it would
    finally:
        Text.draw = draw
    box = figure.bbox
    outside = []
    for text in drawn:
        if not text.get_visible() or not text.get_text().strip():
            continue
        extent = text.get_window_extent(renderer)
        if extent.x0 < box.x0 - 1 or extent.y0 < box.y0 - 1 or extent.x1 > box.x1 + 1 or extent.y1 > box.y1 + 1:
            outside.append(f"{text.get_text()!r} at x {extent.x0:.0f}..{extent.x1:.0f}, y {extent.y0:.0f}.."
                           f"{extent.y1:.0f} in a figure of {box.width:.0f} x {box.height:.0f}")
    return outside


def save(figure, path: Path, dpi: int) -> Path:
    """Writes `figure` to `path` and closes it; says on stderr which texts, if any, it could not fit."""
    import matplotlib.pyplot as plt

    cut = outside_the_figure(figure)
    if cut:
        print(f"{path}: text outside the figure: " + "; ".join(cut), file=sys.stderr)
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path
