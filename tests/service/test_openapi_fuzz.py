"""The live API against its own OpenAPI document (issue #33 item 8), by schemathesis: every
operation, with generated valid and invalid requests, must never answer 5xx, must answer only
the status codes and content types it declares, and its bodies must match the declared schemas
(errors are ``application/problem+json``). EXAMPLES per operation and mode keep it
under a minute. Real API process and redis-server; the API's queue has no worker, so
nothing generated is ever compiled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import checks as sc
from schemathesis.generation import GenerationMode

from tests.conftest import ApiProcess

#: generated requests per operation and mode
EXAMPLES = 100
CHECKS = [
    sc.not_a_server_error,
    sc.status_code_conformance,
    sc.content_type_conformance,
    sc.response_schema_conformance,
    sc.response_headers_conformance,
]


def checks_for(operation: Any) -> list[Any]:
    """/readyz answers 503 by design here (no worker serves the queue): it keeps the rest."""
    if operation.path == "/readyz":
        return [c for c in CHECKS if c is not sc.not_a_server_error]
    return CHECKS


@pytest.fixture(scope="module")
def live_schema(start_api: Callable[..., ApiProcess]) -> Any:
    api = start_api(STACKFUSE_QUEUE_NAME="openapi-fuzz")
    return schemathesis.openapi.from_url(f"{api.url}/openapi.json")


def fuzz(operation: Any, mode: GenerationMode) -> None:
    """EXAMPLES generated requests to ``operation``, each answer checked."""
    checks = checks_for(operation)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def keeps_contract(case: Any) -> None:
        case.call_and_validate(checks=checks)

    keeps_contract()


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_every_operation_keeps_its_contract(live_schema: Any, mode: GenerationMode) -> None:
    operations = [result.ok() for result in live_schema.get_all_operations()]
    assert len(operations) >= 6  # /optimize, /jobs/{id} and its downloads, health, metrics
    fuzzed = []
    for operation in operations:
        try:
            fuzz(operation, mode)
        except Unsatisfiable:
            # negative mode: every value its parameters admit is valid (e.g. a free-form id)
            assert mode is GenerationMode.NEGATIVE, operation.label
            continue
        fuzzed.append(operation.label)
    assert "POST /optimize" in fuzzed, fuzzed
