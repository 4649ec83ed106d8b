"""A pipeline schedule's picture (``diphoma inspect --plot schedule.png``): the blocks of
``passes/pipeline_timeline.timeline`` drawn as ranks x time. matplotlib is imported only to
draw."""

from __future__ import annotations

from pathlib import Path

from ..passes.pipeline_timeline import Block, ScheduleError, bubble


def plot(blocks: list[Block], path: str | Path, title: str = "") -> Path:
    """Draw ``blocks`` as ranks x time (forward blocks light, backward dark, labelled with
    stage and microbatch) into ``path`` (png, svg, pdf: by its suffix)."""
    try:
        import matplotlib
    except ImportError:
        raise ScheduleError("--plot needs matplotlib, which is not installed",
                            hint="pip install matplotlib (or pip install "
                                 "'diphoma_compile[dev]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ranks = sorted({b.rank for b in blocks})
    span = max(b.end for b in blocks)
    stages = max(b.stage for b in blocks) + 1
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(blocks) / max(len(ranks), 1)),
                                    0.6 * len(ranks) + 1.2))
    colors = plt.get_cmap("tab10")
    for b in blocks:
        shade = colors(b.stage % 10 if stages > 1 else 0)
        alpha = {"F": 0.4, "I": 0.75, "W": 0.95}.get(b.kind, 0.95)
        ax.barh(b.rank, b.end - b.start, left=b.start, height=0.8, color=shade, alpha=alpha,
                edgecolor="black", linewidth=0.5)
        label = f"{b.kind}{b.microbatch}" if stages == len(ranks) else \
            f"{b.stage}{b.kind}{b.microbatch}"
        ax.text(b.start + (b.end - b.start) / 2, b.rank, label, ha="center", va="center",
                fontsize=7)
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time (stage costs; F light, B / I / W darker)")
    # wrapped: a long title (the schedule, its stages and both bubbles) ran past a narrow
    # figure's edge
    ax.set_title(title or f"bubble {bubble(blocks):.1%}", fontsize=8, wrap=True)
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    fig.tight_layout()
    path = Path(path)
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:
        raise ScheduleError(f"cannot write the schedule picture {path}: {e}",
                            hint="a writable path ending in .png, .svg or .pdf") from None
    finally:
        plt.close(fig)
    return path
