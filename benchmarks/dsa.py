"""DeepSeek Sparse Attention on CPU: what a decoding pass dispatches and what a prefill costs.

* decode: dispatched operators of one decoded token through the cache API, per block pass,
  for a narrow looped DSA model with the LT2 0.6B mixer options (top-k 2048, an indexer of 64
  heads × 128; ``model.d_model`` narrowed so a CPU affords contexts past top-k), on the
  growing cache and on the static cache, with the history below and above top-k;
* prefill: time of one cached forward of batch 2 × S = 512 through LT2's tiny GDN+DSA
  hybrid (d_model 256, 4 heads, indexer dim 64) at top-k 128 (most queries sparse) and 512
  (every query dense), the fastest of ``--repeat`` after a warm-up, by this process's CPU
  time (``--clock process``, the default: on a machine shared with other jobs, with
  ``--threads 1``, it leaves out the time spent waiting for a core) or the wall clock.

    python benchmarks/dsa.py [--threads 1] [--repeat 3] [--clock process]
"""

from __future__ import annotations

import argparse
import time

import torch

from looplm import LoopLM, load_config
from looplm.accounting.dispatch import count_dispatch
from looplm.cache import LoopCache

#: the narrow decode model: LT2 0.6B's DSA options on a looped DSA model CPU-sized
DECODE_OVERRIDES = ["model.d_model=128", "model.n_heads=2", "model.mixer.top_k=2048", "model.mixer.index_heads=64",
                    "model.mixer.index_head_dim=128", "model.max_seq_len=4096"]
PREFILL_OVERRIDES = ["model.d_model=256", "model.n_heads=4", "model.mixer.index_head_dim=64", "model.max_seq_len=1024"]


def decode_ops(context: int, static: bool) -> tuple[float, float]:
    """(operators, host syncs) of one decoded token per block pass after a prompt of ``context``."""
    torch.manual_seed(0)
    model = LoopLM(load_config("tiny-lt2-dsa", DECODE_OVERRIDES).model).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, context))
    with torch.no_grad():
        cache = LoopCache(full_loop=static)
        model(ids, cache=cache, logits_to_keep=1)
        if static:
            cache = cache.static(context + 4)
        token = ids[:, -1:]
        for _ in range(2):  # past the growing cache's first move into spare rows
            model(token, cache=cache, logits_to_keep=1)
        count, _ = count_dispatch(lambda: model(token, cache=cache, logits_to_keep=1))
    return count.ops / model.cfg.block_passes, count.syncs


def prefill_seconds(top_k: int, repeat: int, clock=time.process_time) -> float:
    torch.manual_seed(0)
    model = LoopLM(load_config("tiny-lt2-hybrid-gdn-dsa", [*PREFILL_OVERRIDES, f"model.mixer.top_k={top_k}"]).model)
    model.eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 512))
    times = []
    with torch.no_grad():
        for _ in range(repeat + 1):  # the first is a warm-up
            start = clock()
            model(ids, cache=LoopCache(), logits_to_keep=1)
            times.append(clock() - start)
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--clock", choices=("process", "wall"), default="process")
    parser.add_argument("--skip-prefill", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| cache | context | operators per decoded token per block pass | host syncs |")
    print("| --- | --- | --- | --- |")
    for static in (False, True):
        for context in (1024, 2100):
            ops, syncs = decode_ops(context, static)
            print(f"| {'static' if static else 'growing'} | {context} | {ops:.1f} | {syncs} |")
    if not args.skip_prefill:
        print(f"\n| prefill B=2, S=512 | ms ({args.clock} clock) |\n| --- | --- |")
        for top_k in (128, 512):
            clock = time.process_time if args.clock == "process" else time.perf_counter
            print(f"| top_k={top_k} | {prefill_seconds(top_k, args.repeat, clock) * 1e3:.0f} |")


if __name__ == "__main__":
    main()
