"""Write the local lm-eval task of this results folder: next-line choice on held-out pydoc text.

Each item is a passage of three lines from a document of the built-in corpus that the
default job holds out (the hash split of looplm.data.split at data.val_fraction=0.05, so
the model never trained on it) and four candidate next lines: the true one and three lines
of other held-out documents. Seeded; run from the repository root:

    python docs/results/eval-demo/make_task.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from looplm.data.config import DataConfig
from looplm.data.sources import iter_documents
from looplm.data.split import is_validation

HERE = Path(__file__).parent
ITEMS = 200


def usable(line: str) -> bool:
    return 20 <= len(line.strip()) <= 100


def main() -> None:
    rng = random.Random(0)
    held_out = [d for d in iter_documents(DataConfig()) if is_validation(d, 0.05)]
    lines_of = [[line for line in doc.splitlines() if line.strip()] for doc in held_out]
    candidates = [(i, j) for i, lines in enumerate(lines_of) for j in range(3, len(lines)) if usable(lines[j])]
    rng.shuffle(candidates)
    items = []
    for i, j in candidates[:ITEMS]:
        context = "\n".join(lines_of[i][j - 3:j]) + "\n"
        others = [rng.choice([x for x in lines_of[k] if usable(x)] or ["-"])
                  for k in rng.sample([k for k in range(len(lines_of)) if k != i], 3)]
        choices = others + [lines_of[i][j]]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(lines_of[i][j])})
    with open(HERE / "task" / "pydoc_next_line.jsonl", "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
    print(f"{len(items)} items from {len(held_out)} held-out documents")


if __name__ == "__main__":
    main()
