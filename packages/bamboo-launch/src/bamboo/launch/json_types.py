"""The types of JSON values, named once: what bamboo-launch writes and reads as JSON (or YAML): DeepSpeed
configs, job specs and records, reports, Kubernetes manifests.

:data:`JSON` takes its containers as ``Mapping`` and ``Sequence`` so that a ``dict[str, str]`` or a
``list[int]`` is a JSON value as it is; :data:`JSONObject` is the mutable ``dict`` a function builds and returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

__all__ = ["JSON", "JSONObject"]

JSON: TypeAlias = "Mapping[str, JSON] | Sequence[JSON] | str | int | float | bool | None"
"""A JSON value: an object, an array, a string, a number, a boolean or null."""
JSONObject: TypeAlias = "dict[str, JSON]"
"""A JSON object, as a function builds it."""
