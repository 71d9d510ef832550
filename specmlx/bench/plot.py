"""The plot of a result: speedup and τ against γ per category, a row per temperature."""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecmlxError
from .modes import TARGET

# Line style and marker per engine family (specmlx solid, mlx-lm dashed, then others).
STYLES = [("-", "o"), ("--", "x"), (":", "s"), ("-.", "^")]


def plot(result: dict, path: Path) -> None:
    """Speedup vs γ per category and τ vs γ, specmlx solid, mlx-lm dashed; a row per T."""
    try:
        import matplotlib
    except ImportError:
        raise SpecmlxError(
            "--plot needs matplotlib; install it with `pip install 'specmlx[bench]'`"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["summary"] if r["mode"] != TARGET.name and r["gamma"] != 0]
    temps = sorted({r["temperature"] for r in rows})
    if not temps:
        raise SpecmlxError("nothing to plot: the run has no speculative modes")
    ints = sorted({r["gamma"] for r in rows if isinstance(r["gamma"], int)})
    xpos: dict = {g: g for g in ints}
    if any(r["gamma"] == "auto" for r in rows):
        xpos["auto"] = (max(ints) if ints else 0) + 1  # drawn right of the fixed γs
    categories = sorted({r["category"] for r in rows} - {"all"}) + ["all"]
    # specmlx first, mlx-lm second, then other draft modes, each in its own line style
    families = sorted({r["family"] for r in rows}, key=lambda f: (f != "specmlx", f != "mlx-lm", f))
    tab20 = plt.get_cmap("tab20")
    # tab20 pairs a dark and a light shade; all dark shades first keeps neighbours distinct
    palette = [tab20(i) for i in [*range(0, 20, 2), *range(1, 20, 2)]]
    fig, axes = plt.subplots(len(temps), 2, figsize=(12, 4 * len(temps)), squeeze=False)
    for row, temp in zip(axes, temps, strict=True):
        for ci, category in enumerate(categories):
            for fi, family in enumerate(families):
                style, marker = STYLES[fi % len(STYLES)]
                mine = [
                    r
                    for r in rows
                    if r["family"] == family
                    and r["category"] == category
                    and r["temperature"] == temp
                ]
                if not mine:
                    continue
                is_all = category == "all"
                kw = {
                    "linestyle": style,
                    "marker": marker,
                    "color": "black" if is_all else palette[ci % 20],
                    "linewidth": 2.5 if is_all else 1,
                    "label": f"{family} {category}",
                }
                # fixed γs joined by a line; auto is a policy, not a point on that line
                fixed = sorted((r for r in mine if r["gamma"] != "auto"), key=lambda r: r["gamma"])
                for col, key in ((0, "speedup_median"), (1, "tau")):
                    if fixed:
                        row[col].plot([r["gamma"] for r in fixed], [r[key] for r in fixed], **kw)
                    for r in mine:
                        if r["gamma"] == "auto":
                            auto_kw = {**kw, "marker": "*", "markersize": 11, "linestyle": "none"}
                            if fixed:
                                auto_kw.pop("label")
                            row[col].plot([xpos["auto"]], [r[key]], **auto_kw)
        row[0].axhline(1.0, color="grey", linewidth=0.8)
        row[0].set_title(f"decode speedup vs target alone (median of pairs), T={temp:g}")
        row[1].set_title(f"τ: tokens per target forward, T={temp:g}")
        for ax in row:
            ax.set_xticks(list(xpos.values()), [str(g) for g in xpos])
            ax.set_xlabel("γ (draft tokens per round)")
            ax.grid(alpha=0.3)
    axes[0][1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    m = result["models"]
    fig.suptitle(
        f"{m['target']['name']} / {m['draft']['name'] if m['draft'] else '-'} · "
        f"{result['machine']['cpu']} · {result['machine']['backend']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
