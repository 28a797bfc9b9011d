"""The fault-free references that `bamboo.rc.verify` keeps for the runs of one process (`REFERENCES_KEPT`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from bamboo.rc import verify
from bamboo.rc.reference import ReferenceResult


def _trainer(trained: list[int], value: int) -> Callable[[], ReferenceResult]:
    def train() -> ReferenceResult:
        trained.append(value)
        return ReferenceResult(layer_states=[], losses=[float(value)])

    return train


def test_a_reference_is_trained_once_per_key_and_the_least_recently_used_goes_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(verify, "_KEPT_REFERENCES", type(verify._KEPT_REFERENCES)())
    monkeypatch.setattr(verify, "REFERENCES_KEPT", 2)
    trained: list[int] = []
    first = verify._kept_reference(("a",), _trainer(trained, 1))
    assert verify._kept_reference(("a",), _trainer(trained, 9)) is first
    verify._kept_reference(("b",), _trainer(trained, 2))
    verify._kept_reference(("a",), _trainer(trained, 9))  # "a" used last: "b" goes next
    verify._kept_reference(("c",), _trainer(trained, 3))
    assert trained == [1, 2, 3]
    assert list(verify._KEPT_REFERENCES) == [("a",), ("c",)]
    assert verify._kept_reference(("b",), _trainer(trained, 4)).losses == [4.0]


def test_a_model_of_the_callers_own_is_trained_every_time() -> None:
    trained: list[int] = []
    verify._kept_reference(None, _trainer(trained, 1))
    verify._kept_reference(None, _trainer(trained, 2))
    assert trained == [1, 2]
