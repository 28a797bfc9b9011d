"""The attrs validators that several bench modules compose the same way, defined once."""

from __future__ import annotations

import attrs

__all__ = ["POSITIVE_INT", "PROBABILITY"]

PROBABILITY = attrs.validators.and_(attrs.validators.ge(0), attrs.validators.le(1))
"""A probability: a number in [0, 1]."""

POSITIVE_INT = attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.gt(0))
"""A whole count: an int > 0."""
