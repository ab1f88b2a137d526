"""Bodies generated from the server's own OpenAPI schema (schemathesis, valid and invalid), sent
to a real `forerun serve` subprocess (tiny float64 models, draft speculation): none gets a 5xx,
none hangs, and the server still answers correctly after all of them."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from test_serve import KEY, NAME, PROMPTS, client, model_dirs, reference, server  # noqa: F401

AUTH = {"Authorization": f"Bearer {KEY}"}
REQUEST_TIMEOUT_S = 60  # a request that takes longer is a hang
EXAMPLES = 40  # per operation and mode


@pytest.fixture(scope="module")
def api(server):  # noqa: F811
    return schemathesis.openapi.from_url(f"{server}/openapi.json", headers=AUTH)


# bodies that fit the schema, and bodies that do not (GET /v1/models takes nothing to break)
@pytest.mark.parametrize(("path", "mode"), [
    *[(p, m) for p in ("/v1/completions", "/v1/chat/completions") for m in GenerationMode],
    ("/v1/models", GenerationMode.POSITIVE)])
def test_schema_generated_requests_never_5xx_or_hang(api, server, path, mode):  # noqa: F811
    ops = [r.ok() for r in api.get_all_operations() if r.ok().path == path]
    assert ops, f"{path} is not in the server's OpenAPI schema"

    @given(case=ops[0].as_strategy(mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    def check(case):
        response = case.call(base_url=server, headers=AUTH, timeout=REQUEST_TIMEOUT_S)
        assert response.status_code < 500, (case.method, path, case.body, response.text[:500])
        if response.status_code >= 400:
            assert response.json()["error"]["message"]  # OpenAI-style, with a message

    check()


def test_the_server_still_serves_after_them(server, reference):  # noqa: F811
    out = client(server).completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8,
                                            temperature=0)
    assert out.choices[0].text == reference(PROMPTS[0], 8).text
