"""Studies: named sets of configurations trained on the same data, budget and seeds, with
mean ± standard deviation over seeds and the papers' numbers beside them (``looplm study``).

- :mod:`~looplm.study.definition`: what a study is (sizes, runs, metrics, paper columns, figures);
- :mod:`~looplm.study.runs`: train or reuse one run, resume an interrupted one, refuse foreign ones;
- :mod:`~looplm.study.measures`: what is read from a finished run (loss, FLOPs, probes, task scores);
- :mod:`~looplm.study.runner`: every run at every seed, then the tables and figures;
- :mod:`~looplm.study.results`, :mod:`~looplm.study.plots`: results.md / results.csv / runs.csv / series.csv, *.png;
- :mod:`~looplm.study.studies`: the studies (mesh, spiralformer, sgt, lt2, ladder, depth, sharing, ...);
- :mod:`~looplm.study.claims`: the papers' claims as paired comparisons in those tables, and their verdicts.
"""

from looplm.study.definition import Bars, Curve, Metric, PaperColumn, RunSpec, Size, Study
from looplm.study.results import StudyResult, results_table
from looplm.study.runner import resolve_seeds, run_ladder, run_study
from looplm.study.runs import Run
from looplm.study.studies import STUDIES, get_study, ladder_study, study_names

__all__ = [
    "STUDIES",
    "Bars",
    "Curve",
    "Metric",
    "PaperColumn",
    "Run",
    "RunSpec",
    "Size",
    "Study",
    "StudyResult",
    "get_study",
    "ladder_study",
    "resolve_seeds",
    "results_table",
    "run_ladder",
    "run_study",
    "study_names",
]
