"""The verdict on one of kvpool's figures beside the paper's (`kvpool sim experiment all`):

- `within 25%`: |kvpool - paper| <= 25% of the paper's value (or 2.5 points, for a share in
  percent under 10);
- `inside the band`: otherwise, when the paper's value lies inside the range kvpool gives over
  its calibration's neighbourhood (experiments/band.py);
- `outside (higher|lower)`: neither.
"""

from __future__ import annotations

RELATIVE_TOLERANCE = 0.25
ABSOLUTE_FLOOR = 2.5
"""A paper figure under 10 is judged within this many units (a share of 3.3% is read by eye
to about a point; 25% of it would ask for a precision the figure does not have)."""


def verdict(ours: float, paper: float, band: tuple[float, float] | None = None,
            percent: bool = False) -> str:
    """The verdict on one figure; `percent`: a share in percent (the floor applies)."""
    floor = ABSOLUTE_FLOOR if percent and abs(paper) < 10 else 0.0
    allowed = max(RELATIVE_TOLERANCE * abs(paper), floor)
    if abs(ours - paper) <= allowed:
        return "within 25%"
    if band is not None and band[0] <= paper <= band[1]:
        return "inside the band"
    return f"outside ({'higher' if ours > paper else 'lower'})"


def in_percent(field: str) -> bool:
    """Whether a row field is a share or a change in percent (the floor applies to it)."""
    return "share" in field or "pct" in field
