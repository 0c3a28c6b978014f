"""Prefill times measured alone on a busy host (CPU burners switched on and off between
requests), as (input_len, prefix_len, seconds), oldest first: mostly 158-token prompts that
took 0.19-1.6 s, a few chats of other lengths around them, the 185-token chat that took 1.46 s.
A least-squares fit with negative terms clipped to 0 predicted several seconds for 158 tokens
and minutes for 1,500 from samples like these."""

from __future__ import annotations

BUSY_HOST = [
    (158, 0, 0.19), (158, 0, 0.23), (158, 0, 0.31), (158, 0, 0.27), (158, 0, 0.95),
    (158, 0, 1.60), (158, 0, 0.42), (158, 0, 0.21), (158, 0, 1.12), (158, 0, 0.36),
    (158, 0, 0.25), (158, 0, 0.74), (158, 0, 0.22), (158, 0, 1.31), (158, 0, 0.29),
    (158, 0, 0.58), (141, 0, 0.17), (146, 0, 0.20), (163, 0, 1.21), (171, 0, 1.38),
    (185, 0, 1.46), (152, 0, 0.26), (137, 0, 0.18), (166, 0, 0.88),
]
