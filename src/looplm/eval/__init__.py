"""Evaluating a trained run: everything that reads a model from above, one concept a module.

- :mod:`~looplm.eval.load`: a run, checkpoint or ``save_pretrained`` directory loaded for
  evaluation (:func:`load_run`), its data overrides and step-embedding switch;
- :mod:`~looplm.eval.validation`: held-out loss and perplexity (``looplm eval``);
- :mod:`~looplm.eval.text_generation`: a prompt's continuation as text (``looplm generate``);
- :mod:`~looplm.eval.scoring`: log-likelihood of token windows, batched (what the next two share);
- :mod:`~looplm.eval.perplexity`: perplexity on named corpora (``looplm perplexity``);
- :mod:`~looplm.eval.lm_eval`: the lm-evaluation-harness model ``looplm`` (``looplm lm-eval``,
  the ``eval`` extra);
- :mod:`~looplm.eval.suites`: the papers' downstream tables as data (``looplm lm-eval --suite``);
- :mod:`~looplm.eval.niah`: RULER needle-in-a-haystack (``looplm niah``);
- :mod:`~looplm.eval.tasks`: out-of-distribution accuracy on the generated tasks
  (:mod:`looplm.tasks`), and the Trainer's hook that logs it.

The package sits above the model and generation and below the CLI, the trainer and the
transformers export; nothing under the model imports it. Nothing is imported here: the
trainer reaches :mod:`~looplm.eval.tasks` while :mod:`looplm.config` is still loading, and
:mod:`~looplm.eval.load` needs the run config (``looplm.load_run`` / ``looplm.evaluate_run``
are the top-level names).
"""
