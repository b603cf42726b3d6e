"""Results analysis behind `raysb pareto`: load finished trials, find the time-vs-error
Pareto frontier, measure time-to-target speedups (the paper's Table 1) and plot them.

    from raysb.analysis.results import load_trials
    from raysb.analysis.report import write_pareto_report

    write_pareto_report(load_trials(["runs/sweep"]), "runs/sweep")
"""

from __future__ import annotations


class AnalysisError(ValueError):
    """Trials that cannot be analysed: a missing folder, no evaluated epochs, no baseline."""
