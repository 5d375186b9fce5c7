"""Figures and comparisons from tltsim / tltrun result files (matplotlib)."""


class ReportError(ValueError):
    """A result directory or file a figure cannot be drawn from: one line naming it, which the
    CLIs print as a usage error. Any other exception while drawing is a bug of ours."""


def step_axis(ax, steps) -> None:
    """An x axis of RL steps: integer ticks, and a run of one step centred on a two-step-wide
    axis (matplotlib's automatic range for one point ran -0.045..0.045 with fractional ticks)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    values = sorted({int(v) for v in steps})
    if len(values) == 1:
        ax.set_xlim(values[0] - 1, values[0] + 1)
