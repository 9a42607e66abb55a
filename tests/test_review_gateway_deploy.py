"""Adversarial review of the tool gateway (ADR 0022): production refuses a configured ticket/model URL
that is not https ("the credential sent to it would travel in clear", E012–E014), yet a destination
listed in FAULTDESK_GATEWAY_ALLOW_<TOOL> gets the same credential injected and is not checked."""

from __future__ import annotations

from tests.test_deploy_files import ENV_EXAMPLE, _deploy_problems, verify


def test_an_http_destination_listed_for_a_credentialed_tool_is_refused_in_production():
    env = verify.fill_env(verify.read_env_example(ENV_EXAMPLE))
    assert _deploy_problems(env) == []
    env["FAULTDESK_GATEWAY_ALLOW_TICKET_REFERENCE"] = "http://tickets-proxy.example:8080"
    env["FAULTDESK_GATEWAY_ALLOW_MODEL"] = "http://old-model.example:8000/v1"
    problems = _deploy_problems(env)
    assert any("GATEWAY_ALLOW" in p for p in problems), problems
