"""Parameter counts now live in :mod:`looplm.accounting.params`; re-exported here."""

from looplm.accounting.params import COMPONENTS, parameter_counts

__all__ = ["COMPONENTS", "parameter_counts"]
