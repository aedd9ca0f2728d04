"""The studies of ``looplm study NAME``: each paper's headline comparison, shrunk to a size
that trains on 2 CPU cores in about an hour with 3 seeds (``default``), a seconds-scale
smoke version (``quick``, used by the tests) and the paper's size (``paper``, GPUs); one
module per study, the budgets they share in :mod:`~looplm.study.studies.common`.

Every configuration and hyperparameter of a table is here (or in the presets named), so
each table is one command. Wall times of the ``default`` sizes (each size's ``wall_time``)
were estimated from a timed 40-step run of every variant (``--seeds 1 --threads 1
train.max_steps=40``) on the 2-core AMD EPYC this project is developed on, shared with other
jobs at the time, so scaled by the CPU time the run used (its user/wall ratio); expect ±30 %.
Paper sizes need GPUs and the paper's corpus as
token shards (``data.source=shards:DIR data.tokenizer=TOKENIZER``), except the ladder's,
whose data is synthetic.
"""

from __future__ import annotations

from looplm.config_base import ConfigError
from looplm.study.definition import Study
from looplm.study.studies.conversion import CONVERSION
from looplm.study.studies.depth import DEPTH
from looplm.study.studies.distill import DISTILL
from looplm.study.studies.ladder import ladder_study, paper_ladder, registered_ladder
from looplm.study.studies.lt2 import LT2
from looplm.study.studies.mesh import MESH
from looplm.study.studies.sgt import SGT
from looplm.study.studies.sharing import SHARING
from looplm.study.studies.spiralformer import SPIRALFORMER

#: name -> study; the ladder is built per size (:func:`get_study`)
STUDIES: dict[str, Study] = {s.name: s for s in (MESH, SPIRALFORMER, SGT, LT2, DEPTH, SHARING, CONVERSION, DISTILL)}


def get_study(name: str, size: str = "default") -> Study:
    """The study ``name`` (the ladder's budget is C = 24 at the paper size, 12 otherwise)."""
    if name == "ladder":
        return paper_ladder() if size == "paper" else registered_ladder()
    if name not in STUDIES:
        raise ConfigError("study", name, "one of " + ", ".join(study_names()))
    return STUDIES[name]


def study_names() -> list[str]:
    return [*STUDIES, "ladder"]


__all__ = ["STUDIES", "get_study", "ladder_study", "study_names"]
