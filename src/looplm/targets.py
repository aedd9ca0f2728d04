"""The target value that carries no loss, shared by the model, tasks, halting and probes."""

#: Targets equal to this are ignored by every loss (prompt, padding); PyTorch's
#: ``cross_entropy`` default, so it can be passed straight through.
IGNORE_INDEX = -100
