"""Drawing the picture with matplotlib (Agg backend): the layer boxes with their legend
on the left, the largest parameters cut into shard tiles on the right."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from autopar.errors import RenderError, format_bytes
from autopar.plan.plan import Plan
from autopar.plan.schedule import Timeline, schedule_line, timeline
from autopar.tools.inspect.format import format_seconds, full_bytes, shape_text
from autopar.tools.render.layout import (
    DEFAULT_TOP,
    REPLICATED,
    LayerGroup,
    ParamGroup,
    layer_groups,
    param_groups,
)

FORMATS = ("png", "svg", "pdf")
BOXES_PER_COLUMN = 20
MAX_SLOTS = 8  # tiles drawn along one direction; more print as 0 1 2 ... k-1

_STRATEGY_COLOURS = (
    "#8ecae6",
    "#ffb703",
    "#90be6d",
    "#f28482",
    "#b8b8ff",
    "#f4a261",
    "#84a59d",
    "#e9c46a",
    "#cdb4db",
    "#a3c4f3",
)
_NONE_COLOUR = "#e6e6e6"
_AXIS_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
_SPLIT_COLOURS = ("#2a9d8f", "#e76f51", "#6d597a", "#264653", "#bc6c25", "#457b9d")


def _colour_map(keys, palette) -> dict:
    out: dict = {}
    for k in keys:
        if k is not None and k not in out:
            out[k] = palette[len(out) % len(palette)]
    return out


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _slots(k: int) -> list[int | None]:
    """Tile indices drawn along one direction: all of them, or 0..5, …, k-1."""
    if k <= MAX_SLOTS:
        return list(range(k))
    return [*range(MAX_SLOTS - 2), None, k - 1]


def _label_stride(tile_pts: float, font_pts: float) -> int:
    """The n with which to label every n-th of a row or column of tiles `tile_pts`
    points apart, so that labels `font_pts` high do not overlap."""
    return max(1, math.ceil(1.25 * font_pts / max(tile_pts, 1e-9)))


def _labelled(n: int, every: int) -> set[int]:
    """Which of `n` tiles get a label: every `every`-th, the last in place of the one
    before it where they would be closer."""
    shown = list(range(0, n, every))
    if shown[-1] != n - 1:
        if n - 1 - shown[-1] < every:
            shown[-1] = n - 1
        else:
            shown.append(n - 1)
    return set(shown)


def _coords(i: int, axes: tuple[str, ...], sizes: dict[str, int]) -> str:
    """Mesh coordinates of shard `i` of a dimension split over `axes` (major to minor):
    `model 3`, or `data 1,model 3`."""
    out = []
    for a in reversed(axes):
        out.append(f"{a} {i % sizes[a]}")
        i //= sizes[a]
    return ",".join(reversed(out))


def _major(i: int | None, axes: tuple[str, ...], sizes: dict[str, int]) -> int:
    """The coordinate along the major axis of shard `i` over `axes` (0 if none)."""
    if i is None or not axes:
        return 0
    return i // math.prod(sizes[a] for a in axes[1:])


def _fraction(total: float, local: float) -> str:
    frac = total / local if local else 1
    return f"1/{frac:.0f}" if frac > 1.01 else "whole"


def _over(split: str) -> str:
    return split if split == REPLICATED else f"split over {split}"


def _draw_layers(ax, groups: list[LayerGroup], plan: Plan, strat_colour, split_colour, ncols):
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    per_col = math.ceil(len(groups) / ncols)
    box_w, box_h, gap = 1.0, 1.0, 0.38
    col_w = box_w + 0.12
    ax.set_xlim(-0.02, ncols * col_w)
    ax.set_ylim(-(per_col * (box_h + gap)) + gap - 0.05, 0.05)
    ax.axis("off")
    centres = []
    for k, d in enumerate(groups):
        col, row = divmod(k, per_col)
        x0, y1 = col * col_w, -row * (box_h + gap)
        y0 = y1 - box_h
        fill = strat_colour.get(d.dominant, _NONE_COLOUR)
        ax.add_patch(
            FancyBboxPatch(
                (x0, y0),
                box_w,
                box_h,
                boxstyle="round,pad=0,rounding_size=0.04",
                facecolor=fill,
                edgecolor="#333333",
                linewidth=0.8,
            )
        )
        ax.add_patch(
            Rectangle((x0, y0), 0.035, box_h, facecolor=split_colour[d.split], edgecolor="none")
        )
        n = len(d.names)
        per = "/layer" if n > 1 else ""
        lines = [
            f"{d.ops} ops{per}, compute {format_seconds(d.compute_s)}{per}",
        ]
        if d.dominant:
            lines.append(f"{_clip(d.dominant, 52)}  ({d.dominant_share})")
        else:
            lines.append("no contractions")
        if d.param_bytes:
            lines.append(
                f"{'params' if d.has_params else 'arrays'} {format_bytes(d.param_bytes)}{per} -> "
                f"{format_bytes(d.param_local_bytes)}/dev "
                f"({_fraction(d.param_bytes, d.param_local_bytes)}), {_over(d.split)}"
            )
        if d.state_bytes:
            lines.append(
                f"opt state {format_bytes(d.state_bytes)} -> {format_bytes(d.state_local_bytes)}/dev "
                f"({_fraction(d.state_bytes, d.state_local_bytes)}), {_over(d.state_split)}"
            )
        ax.text(
            x0 + 0.06,
            y1 - 0.1,
            d.label,
            fontsize=8.5,
            fontweight="bold",
            va="top",
            ha="left",
            family="DejaVu Sans",
        )
        ax.text(
            x0 + 0.06,
            y1 - 0.3,
            "\n".join(lines),
            fontsize=6.5,
            va="top",
            ha="left",
            family="DejaVu Sans Mono",
            linespacing=1.35,
        )
        centres.append((x0 + box_w / 2, y0, y1))
    for (xa, ya0, _), (xb, _, yb1) in zip(centres, centres[1:]):
        if abs(xa - xb) < 1e-9:
            ax.add_patch(
                FancyArrowPatch(
                    (xa, ya0),
                    (xb, yb1),
                    arrowstyle="-|>",
                    mutation_scale=8,
                    color="#555555",
                    linewidth=0.8,
                )
            )
    ax.set_title(
        "layers, in program order",
        fontsize=8,
        loc="left",
    )


def _draw_param(ax, pg: ParamGroup, plan: Plan, axis_colour):
    from matplotlib.patches import Rectangle

    r, mesh = pg.record, plan.mesh
    sizes = mesh.shape
    dims = r.spec.dims[: len(r.shape)]
    ax.axis("off")
    ax.set_xlim(-0.32, 1.02)
    ax.set_ylim(-0.32, 1.34)
    # rows: dim 0 (for rank >= 2); columns: the other dims, nested, major to minor
    if len(r.shape) >= 2:
        row_axes: tuple[str, ...] = dims[0]
        col_dims = [(i, dims[i]) for i in range(1, len(r.shape))]
        rows_n, cols_n = r.shape[0], math.prod(r.shape[1:])
    else:
        row_axes, col_dims = (), [(0, dims[0])]
        rows_n, cols_n = 1, r.shape[0]
    col_axes = tuple(a for _, d in col_dims for a in d)
    k_rows = math.prod(sizes[a] for a in row_axes)
    k_cols = math.prod(sizes[a] for a in col_axes)
    ratio = math.log10(max(cols_n, 1) / max(rows_n, 1)) if len(r.shape) >= 2 else None
    if ratio is None:
        w, h = 1.0, 0.16
    else:
        ratio = max(-0.6, min(0.6, ratio))
        w, h = (1.0, 10**-ratio) if ratio >= 0 else (10**ratio, 1.0)
        w, h = w * 0.95, h * 0.95
    x0, y1 = 0.0, 1.0
    rs, cs = _slots(k_rows), _slots(k_cols)
    tw, th = w / len(cs), h / len(rs)
    row_c = axis_colour.get(row_axes[0]) if row_axes else None
    col_c = axis_colour.get(col_axes[0]) if col_axes else None
    import matplotlib.colors as mcolors

    for a, ri in enumerate(rs):
        for b, ci in enumerate(cs):
            mine = (ri == 0 or not row_axes) and (ci == 0 or not col_axes)
            base = row_c or col_c or "#bbbbbb"
            if row_c and col_c:
                base = row_c if (a + b) % 2 == 0 else col_c
            rgb = mcolors.to_rgb(base)
            # lighter or darker by the major axis' coordinate, a little by the minor one
            major = _major(ri, row_axes, sizes) + _major(ci, col_axes, sizes)
            shade = (
                0.0
                if mine and (row_axes or col_axes)
                else 0.45 + 0.22 * (major % 2) + 0.1 * ((a + b) % 2)
            )
            colour = tuple(c + (1 - c) * shade for c in rgb)
            ellipsis = ri is None or ci is None
            ax.add_patch(
                Rectangle(
                    (x0 + b * tw, y1 - (a + 1) * th),
                    tw,
                    th,
                    facecolor="#f4f4f4" if ellipsis else colour,
                    edgecolor="white" if (row_axes or col_axes) else "#777777",
                    linewidth=0.8,
                    hatch="..." if ellipsis else None,
                )
            )
    ax.add_patch(Rectangle((x0, y1 - h), w, h, fill=False, edgecolor="#333333", linewidth=0.9))
    fs = 5.5
    # label every tile where the labels fit, else every n-th (and always the last)
    box = ax.get_position()
    fig_w, fig_h = ax.figure.get_size_inches()
    row_pts = th / 1.66 * box.height * fig_h * 72  # ylim spans 1.66, xlim 1.34
    col_pts = tw / 1.34 * box.width * fig_w * 72
    row_shown = _labelled(len(rs), _label_stride(row_pts, fs))
    col_shown = _labelled(len(cs), _label_stride(col_pts, fs) if len(cs) > 4 else 1)
    if row_axes:
        for a, ri in enumerate(rs):
            if a not in row_shown:
                continue
            ax.text(
                x0 - 0.015,
                y1 - (a + 0.5) * th,
                "…" if ri is None else _coords(ri, row_axes, sizes),
                fontsize=fs,
                ha="right",
                va="center",
                color=row_c,
            )
    if col_axes:
        for b, ci in enumerate(cs):
            if b not in col_shown:
                continue
            ax.text(
                x0 + (b + 0.5) * tw,
                y1 + 0.015,
                "…" if ci is None else _coords(ci, col_axes, sizes),
                fontsize=fs,
                ha="center",
                va="bottom",
                color=col_c,
                rotation=90 if len(cs) > 4 else 0,
            )
    unused = [a for a in mesh.axis_names if a not in r.spec.used_axes and sizes[a] > 1]
    shards = r.spec.shards(mesh)
    times = f"  x{pg.count}" if pg.count > 1 else ""
    dtype = r.dtype
    local = r.spec.local_shape(r.shape, mesh)
    per = math.prod(local) * (full_bytes(r) // max(math.prod(r.shape), 1))
    info = [
        f"{shape_text(r.shape)} {dtype}  {format_bytes(full_bytes(r))}{' each' if pg.count > 1 else ''}",
        f"spec {r.spec}  {r.spec.to_json()}",
        f"per device {shape_text(local)} = {format_bytes(per)}"
        + (f" (1/{shards})" if shards > 1 else " (whole)"),
    ]
    if unused:
        info.append("replicated over " + ", ".join(f"{a}={sizes[a]}" for a in unused))
    ax.text(
        x0 - 0.3,
        y1 - h - 0.04,
        _clip(pg.name, 52) + times,
        fontsize=7.5,
        va="top",
        ha="left",
        fontweight="bold",
    )
    ax.text(
        x0 - 0.3,
        y1 - h - 0.14,
        "\n".join(info),
        fontsize=6,
        va="top",
        ha="left",
        family="DejaVu Sans Mono",
        linespacing=1.3,
    )


def render_plan(plan: Plan, out: str | Path, top: int = DEFAULT_TOP, title: str = "") -> Path:
    """Draw `plan` into `out` (.png, .svg or .pdf). Returns the path written."""
    out = Path(out)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise RenderError(
            f"cannot tell the picture format from {str(out)!r}: name it .png, .svg or .pdf"
        )
    if not out.parent.is_dir():
        raise RenderError(f"cannot write {out}: directory {out.parent} does not exist")
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    groups = layer_groups(plan)
    params = param_groups(plan, top)
    strat_colour = _colour_map(
        sorted(
            {g.dominant for g in groups if g.dominant},
            key=lambda s: -sum(g.contractions[s] for g in groups),
        ),
        _STRATEGY_COLOURS,
    )
    split_colour = {REPLICATED: "#bdbdbd"}
    split_colour.update(
        _colour_map([g.split for g in groups if g.split != REPLICATED], _SPLIT_COLOURS)
    )
    axis_colour = dict(zip(plan.mesh.axis_names, _AXIS_COLOURS * 4))

    ncols = max(1, math.ceil(len(groups) / BOXES_PER_COLUMN))
    per_col = math.ceil(len(groups) / ncols)
    box_in = 1.0  # inches per box, gap included
    layers_h = per_col * box_in + 0.4
    legend_h = 0.25 + 0.16 * (len(strat_colour) + len(split_colour) + 3)
    p_cols = 2 if len(params) > 1 else 1
    p_rows = math.ceil(len(params) / p_cols)
    cell_w, cell_h = 3.3, 2.9
    left_w = 5.0 * ncols
    right_w = p_cols * cell_w + 0.3 if params else 0.0
    fig_w = left_w + right_w + 0.3

    c = plan.cost
    mesh = " x ".join(f"{a}={s}" for a, s in plan.mesh.shape.items())
    hbm = float(plan.cluster.get("hbm_bytes", 0) or 0)
    subtitle = textwrap.fill(
        f"mesh {mesh} ({plan.mesh.num_devices} devices), cluster {plan.cluster.get('name', '?')}, "
        f"engine {plan.engine}; predicted step {format_seconds(c.step_s)} = compute "
        f"{format_seconds(c.compute_s)} + communication {format_seconds(c.comm_s)}; peak memory "
        f"{format_bytes(c.peak_memory_bytes)}/device"
        + (f" ({c.peak_memory_bytes / hbm * 100:.0f}% of HBM)" if hbm else "")
        + f"; {len(plan.inputs)} inputs, {len(plan.ops)} ops",
        int(fig_w / 0.062),
    )
    caption = textwrap.fill(
        f"largest parameters ({len(params)} shown; xN: N same-shaped ones with this spec): "
        "rows = dim 0, columns = the other dims; one tile per shard, labelled with the mesh "
        "coordinates of the devices holding it; the dark tile is one device's share",
        max(40, int(right_w / 0.058)),
    )
    sub_h = 0.14 * (subtitle.count("\n") + 1)
    cap_h = 0.13 * (caption.count("\n") + 1) if params else 0.0
    header_h = 0.45 + sub_h + max(0.25, cap_h) + 0.1
    body_h = max(layers_h + legend_h, p_rows * cell_h + 0.3)
    sched = timeline(plan.pipeline) if plan.pipeline else None
    sched_h = 1.2 + 0.32 * sched.stages if sched else 0.0
    fig_h = header_h + body_h + sched_h
    fig = Figure(figsize=(fig_w, fig_h), dpi=110)

    def axes(x, y, w, h):  # inches from the top-left corner
        return fig.add_axes((x / fig_w, 1 - (y + h) / fig_h, w / fig_w, h / fig_h))

    fig.text(
        0.15 / fig_w,
        1 - 0.15 / fig_h,
        title or f"autopar plan: {plan.function or 'function'}",
        fontsize=11,
        fontweight="bold",
        va="top",
    )
    fig.text(0.15 / fig_w, 1 - 0.42 / fig_h, subtitle, fontsize=7.5, va="top", linespacing=1.3)
    if params:
        fig.text(
            (left_w + 0.1) / fig_w,
            1 - (header_h - 0.05) / fig_h,
            caption,
            fontsize=7,
            va="bottom",
            linespacing=1.3,
        )

    ax = axes(0.15, header_h, left_w - 0.2, layers_h)
    _draw_layers(ax, groups, plan, strat_colour, split_colour, ncols)

    lax = axes(0.15, header_h + layers_h + 0.05, left_w - 0.2, legend_h)
    lax.axis("off")
    handles = [
        Patch(facecolor=v, edgecolor="#333333", label=_clip(k, 70)) for k, v in strat_colour.items()
    ]
    if any(g.dominant is None for g in groups):
        handles.append(Patch(facecolor=_NONE_COLOUR, edgecolor="#333333", label="no contractions"))
    leg1 = lax.legend(
        handles=handles,
        loc="upper left",
        fontsize=6.5,
        title="fill: most common contraction strategy (out = in0 x in1)",
        title_fontsize=7,
        frameon=False,
        alignment="left",
    )
    lax.add_artist(leg1)
    lax.legend(
        handles=[Patch(facecolor=v, label=k) for k, v in split_colour.items()],
        loc="lower left",
        fontsize=6.5,
        title="strip: mesh axes splitting most parameter bytes",
        title_fontsize=7,
        frameon=False,
        ncols=min(4, len(split_colour)),
        alignment="left",
    )

    for k, pg in enumerate(params):
        row, col = divmod(k, p_cols)
        pax = axes(
            left_w + col * cell_w + 0.3,
            header_h + 0.25 + row * cell_h,
            cell_w - 0.4,
            cell_h - 0.45,
        )
        _draw_param(pax, pg, plan, axis_colour)

    if sched is not None:
        sax = axes(0.9, header_h + body_h + 0.45, fig_w - 1.2, sched_h - 1.15)
        _draw_schedule(sax, sched)

    fig.savefig(out, format=fmt)
    return out


_SLOT_COLOURS = {
    "forward": "#4e79a7",
    "backward": "#f28e2b",
    "weight": "#e15759",  # ZB-H1's deferred weight gradients
    "head": "#59a14f",
}


def _draw_schedule(ax, t: Timeline) -> None:
    """The pipeline's slots per stage over time (`autopar.plan.schedule`): forward,
    backward, weight-gradient and head slots labelled with their micro-batch, idle
    slots hatched."""
    from matplotlib.patches import Patch

    scale, unit = (1.0, "slot units") if t.estimated else (1e3, "ms")
    label = sum(1 for s in t.slots if s.stage == 0) <= 64
    idle = {"facecolors": "#eeeeee", "edgecolors": "#bbbbbb", "hatch": "///", "linewidth": 0.3}
    for s in t.slots:
        x, w = s.start * scale, s.seconds * scale
        busy = s.kind != "idle"
        style = (
            {"facecolors": _SLOT_COLOURS[s.kind], "edgecolors": "white", "linewidth": 0.5}
            if busy
            else idle
        )
        ax.broken_barh([(x, w)], (s.stage - 0.4, 0.8), **style)
        if label and busy:
            ax.text(
                x + w / 2,
                s.stage,
                s.label,
                ha="center",
                va="center",
                fontsize=5.5,
                color="white",
            )
    ax.set_ylim(t.stages - 0.5, -0.5)
    ax.set_yticks(range(t.stages), [f"stage {i}" for i in range(t.stages)], fontsize=7)
    ax.set_xlim(0, t.seconds * scale)
    ax.set_xlabel(unit, fontsize=7)
    ax.tick_params(axis="x", labelsize=6.5)
    ax.set_title(textwrap.fill(schedule_line(t), 160), fontsize=7.5, loc="left")
    kinds = {s.kind for s in t.slots}
    handles = [Patch(facecolor=c, label=k) for k, c in _SLOT_COLOURS.items() if k in kinds]
    handles.append(Patch(facecolor="#eeeeee", edgecolor="#bbbbbb", hatch="///", label="idle"))
    ax.legend(
        handles=handles,
        fontsize=6.5,
        loc="upper left",
        # under the axis label: 0.4 inches below the axes
        bbox_to_anchor=(0.0, -0.4 / (ax.get_position().height * ax.figure.get_figheight())),
        ncols=len(handles),
        frameon=False,
    )
