"""Error-bound policies (fixed, table-wise, dual-level adaptive)."""

from recsz.policy.base import BoundPolicy, FixedBound, to_absolute

__all__ = ["BoundPolicy", "FixedBound", "to_absolute"]
