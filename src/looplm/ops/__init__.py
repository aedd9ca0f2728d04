"""Functional token-mixer operators, one folder per operator family (fla's three-tier shape).

Each family ``ops/<op>/`` has ``naive.py`` (the plain recurrence, the reference),
``chunk.py`` (chunkwise-parallel form for training) and ``recurrent.py`` (O(1)-state steps
for decoding). Ops take ``[B, T, H, K]`` tensors and ``initial_state`` and return
``(o, final_state)``, as flash-linear-attention's ops do.
"""
