"""Results analysis: `raysb pareto` loads finished trials, finds the time-vs-error Pareto
frontier, measures time-to-target speedups (the paper's Table 1) in wall-clock time and in
work (raysb.analysis.work) and plots them;
`raysb report` draws the paper's other figures from `raysb train` run folders and the
trace files they hold (loss CDFs, selection probabilities, gradient similarity,
confidence and accuracy by percentile, selected examples, time per phase, label-noise
and selectivity sensitivity).

    from raysb.analysis.results import load_trials
    from raysb.analysis.report import write_pareto_report
    from raysb.analysis.run_report import write_run_report

    write_pareto_report(load_trials(["runs/sweep"]), "runs/sweep")
    write_run_report(["runs/trad", "runs/sb"], "runs/report")
"""

from __future__ import annotations


class AnalysisError(ValueError):
    """Results that cannot be analysed: a missing folder, a folder that is not a run or sweep,
    no evaluated epochs, no baseline."""
