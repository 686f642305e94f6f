"""Full-graph capture of eager SAC: the module-aware export breaks, a plain policy_fn runs."""

from __future__ import annotations

import pytest

from studies.capture import compile_eager_sac, every_other_mm_policy
from workbench.capture.models import load_workload
from workbench.decide.policy import Policy


@pytest.fixture(scope="module")
def moe():  # type: ignore[no-untyped-def]
    return load_workload("dsv3-debug", layers=2, seq=16)


def test_module_aware_export_is_refused_by_fullgraph(moe) -> None:  # type: ignore[no-untyped-def]
    result = compile_eager_sac(moe, Policy("eager"))
    assert not result.ok
    assert result.error_type == "Unsupported"
    assert "side effect" in result.summary()


def test_plain_policy_fn_compiles_and_matches_eager(moe) -> None:  # type: ignore[no-untyped-def]
    result = compile_eager_sac(moe, policy_fn=every_other_mm_policy)
    assert result.ok and result.bitwise_equal, result.summary()
    counts = result.choice_counts("aten.mm.default")
    assert counts["<no module> save"] > 0 and counts["<no module> recompute"] > 0


def test_exactly_one_policy_source(moe) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        compile_eager_sac(moe)
