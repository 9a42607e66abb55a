"""The candidate of a release-gate run (``manage.py replay_trajectories --bundle``; spec §16.11): which
bundle parts it may set, whether this build carries them, and whether the recorded inputs of the selected
tasks can judge it at all (a new model needs ``--live``; a new embedding model is never exercised by
replay). :mod:`apps.agent.trajectories` re-drives the tasks under it."""

from __future__ import annotations

from django.conf import settings

from apps.agent.bundle import bundle_problem
from apps.agent.controllers import CONTROLLERS
from apps.llm.providers import LOCAL
from apps.tasks import reducer

#: the parts a candidate may set: those of a new task's bundle (apps.tasks.services.artifact_bundle_current)
BUNDLE_PARTS = ("model_provider", "model", "model_base_url", "max_output_tokens", "units_per_1k_tokens",
                "response_format", "output_parser", "prompt_template", "tool_schemas", "controller", "parser",
                "reducer", "embedding_model")

#: parts that change which replies the model gives: recorded replies cannot judge a change to them
MODEL_PARTS = ("model_provider", "model", "model_base_url", "response_format", "max_output_tokens")

#: the output parser of a bundle that pins none (tasks from before output parsers were versioned)
DEFAULT_OUTPUT_PARSER = "model-output-parser/1"


class BundleInvalid(ValueError):
    """A candidate bundle this build cannot run (a part it does not carry), or a malformed one."""


class NotJudgeable(ValueError):
    """A candidate whose change the recorded inputs cannot exercise (a new model without ``live``,
    a new embedding model): the message says what and how to judge it instead."""


def candidate_check(overrides) -> None:
    """Check a candidate's ``overrides`` on their own, before any task: a JSON object of
    :data:`BUNDLE_PARTS` that this build carries (:func:`apps.agent.bundle.bundle_problem`).
    Raises :class:`BundleInvalid` naming the part and what it may be."""
    if not isinstance(overrides, dict):
        raise BundleInvalid(f"the candidate must be a JSON object of bundle parts, not {type(overrides).__name__}")
    unknown = sorted(str(k) for k in overrides if k not in BUNDLE_PARTS)
    if unknown:
        raise BundleInvalid(f"unknown bundle part(s) {', '.join(map(repr, unknown))} "
                            f"(the parts are {', '.join(BUNDLE_PARTS)})")
    for part in ("model", "model_base_url", "embedding_model"):
        if part in overrides and (not isinstance(overrides[part], str) or not overrides[part]):
            raise BundleInvalid(f"{part} {overrides[part]!r} must be non-empty text")
    if problem := bundle_problem(overrides):
        raise BundleInvalid(problem)


def candidate_bundle(base: dict, overrides: dict) -> dict:
    """``base`` (a task's pinned bundle) with ``overrides`` (e.g. ``{"prompt_template":
    "ticket-draft/2"}``) applied. Raises :class:`BundleInvalid` when this build cannot run it."""
    bundle = {**base, **overrides}
    if problem := bundle_problem(bundle):
        raise BundleInvalid(problem)
    if bundle.get("controller", "controller/1") not in CONTROLLERS:
        raise BundleInvalid(f"controller {bundle.get('controller')!r} is not in this build")
    return bundle


def _model_part(bundle: dict, part: str):
    """A bundle's model ``part`` as the provider would use it (apps.llm.providers.provider_for's defaults)."""
    defaults = {"model_provider": LOCAL, "response_format": "json_schema",
                "max_output_tokens": settings.FAULTDESK["MODEL_MAX_OUTPUT_TOKENS"]}
    return bundle.get(part, defaults.get(part))


def drafts_locally(bundle: dict) -> bool:
    """Does a run under ``bundle`` draft with the local drafter (provider ``local``, or a reducer
    without the ledger, whose runs never call a model; apps/agent/drafting.py ``propose``)?"""
    return _model_part(bundle, "model_provider") == LOCAL or not reducer.supports(bundle.get("reducer"), "ledger")


def model_changes(pinned: dict, bundle: dict) -> list[tuple[str, object, object]]:
    """``(part, pinned, candidate)`` for each of :data:`MODEL_PARTS` the candidate ``bundle``
    changes, when the candidate calls a model (a switch to the local drafter changes nothing the
    recorded replies are needed for: the drafter is run)."""
    if drafts_locally(bundle):
        return []
    return [(part, _model_part(pinned, part), _model_part(bundle, part)) for part in MODEL_PARTS
            if _model_part(pinned, part) != _model_part(bundle, part)]


def pinned_problem(pinned: dict, overrides: dict) -> str | None:
    """Why the candidate cannot run on a task because of the task's own bundle: the problem of the
    pinned bundle with ``overrides`` applied, when the pinned bundle has one too (a part this build
    no longer carries that the candidate does not replace). None when the combined bundle runs, or
    when only the candidate makes it fail (then :func:`candidate_bundle` raises)."""
    problem = bundle_problem({**pinned, **overrides})
    return problem if problem and bundle_problem(pinned) else None


def candidate_judgeable(tasks, overrides: dict, *, live: bool = False) -> None:
    """Before any task is replayed: can the recorded inputs of ``tasks`` judge the candidate?
    Raises :class:`BundleInvalid` when the candidate cannot run on one of them (e.g. an
    OpenAI-compatible provider over a task that pins no base URL), :class:`NotJudgeable` when it
    changes the model without ``live`` (:func:`model_changes`) or the embedding model (replay uses
    the recorded retrieval; not even ``live`` re-retrieves). A task whose own bundle cannot run is
    left to :func:`trajectory_replay`, which reports it as not replayable."""
    changed: dict[str, set] = {}
    embedding = set()
    for task in tasks:
        pinned = task.artifact_bundle or {}
        if pinned_problem(pinned, overrides):
            continue
        bundle = candidate_bundle(pinned, overrides)
        if not live:
            for part, old, new in model_changes(pinned, bundle):
                changed.setdefault(part, set()).add(f"{old!r} -> {new!r}")
        if "embedding_model" in overrides and pinned.get("embedding_model") != overrides["embedding_model"]:
            embedding.add(f"{pinned.get('embedding_model')!r} -> {overrides['embedding_model']!r}")
    if embedding:
        raise NotJudgeable(f"the candidate changes embedding_model ({', '.join(sorted(embedding))}): replay re-uses "
                           "each task's recorded retrieval, so a new embedding model is never exercised, not even "
                           "with --live; judge it with manage.py eval_retrieval")
    if changed:
        parts = "; ".join(f"{part} {', '.join(sorted(v))}" for part, v in sorted(changed.items()))
        raise NotJudgeable(f"the candidate changes the model ({parts}): the recorded replies came from the pinned "
                           "model, so only asking the candidate's model can judge it; run again with --live "
                           "(or model_provider=local to re-derive with the local drafter)")
