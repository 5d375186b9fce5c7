"""Figures and comparisons from tltsim / tltrun result files (matplotlib)."""


class ReportError(ValueError):
    """A result directory or file a figure cannot be drawn from: one line naming it, which the
    CLIs print as a usage error. Any other exception while drawing is a bug of ours."""
