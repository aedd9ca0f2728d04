"""Multi-resolution recursion (spiralformer.txt §2.2-2.3): at what sequence resolution each
loop iteration runs. One file per operator:

| file | operator | paper |
| --- | --- | --- |
| ``schedule.py`` | g_t, ω_t, s_t, π_t / ρ_t, complete chunks L_t | Eq. (12-15), §2.4 |
| ``downscale.py`` | S↓: ``mean`` pooling, ``aggregate`` (self-aggregation, scorer A^(t)) | Eq. (16), (17-18) |
| ``upscale.py`` | S↑: ``uniform`` broadcast, ``router`` (output-dependent, B^(t)), λ_t = √g_t | Eq. (19-21) |
| ``shift.py`` | causal right shift | Eq. (22), Prop. 1 |
| ``state.py`` | chunk buffer + finalised latents for decoding | Algorithm 2 |
| ``recursion.py`` | S↓ -> core -> S↑ -> shift for one iteration, training and decoding | Alg. 1-2 |
"""

from looplm.resolution.downscale import MeanPool, SelfAggregation
from looplm.resolution.recursion import Compressed, MultiResolution, build_resolution
from looplm.resolution.schedule import IterationResolution, core_lengths, iteration_resolutions
from looplm.resolution.shift import causal_right_shift
from looplm.resolution.state import ChunkState
from looplm.resolution.upscale import AllocationRouter, UniformBroadcast

__all__ = [
    "AllocationRouter",
    "ChunkState",
    "Compressed",
    "IterationResolution",
    "MeanPool",
    "MultiResolution",
    "SelfAggregation",
    "UniformBroadcast",
    "build_resolution",
    "causal_right_shift",
    "core_lengths",
    "iteration_resolutions",
]
