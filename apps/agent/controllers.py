"""The controller versions this build carries (spec §16.2, §16.11: "release pins the whole artifact
bundle"). A task runs under the controller version it was pinned to; a version not listed here is
refused (:mod:`apps.agent.bundle`), never run with the current one.

* ``controller/1`` — the model's reply is taken as the draft: its priority becomes the ticket's,
  its questions are asked; a rejection refuses only the exact action (its digest) again.
* ``controller/2`` — what *decides* is fixed by rules and policy, what *describes* is the model's,
  screened (spec §16.6 "模型只提出，控制器决定"):

  - the tool, its target, the tenant and whether a person approves were already the controller's
    and the policy's; now the **priority** is the rules' (:func:`apps.llm.drafter.rules_priority`)
    and **asking the requester** is the rules' (a report too short to act on): the model's
    priority and questions are recorded as suggestions, and one outside the rules' range is
    shown to the approver as such;
  - the **title and description** stay the model's, screened (:mod:`apps.llm.screening`):
    sentences no recorded input supports are dropped (and listed), instruction-like text is
    flagged for the approver and the trace;
  - a **rejection** refuses the same action however it is re-worded (``reducer/5``): the re-draft
    after a rejection gets the approver's reason as feedback, and a proposal with a rejected
    action's identity ends the task before any new approval request.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Controller:
    """One controller version's behaviour: ``rules_decide`` (priority and questions by rules, the
    model's as suggestions), ``screens`` (the describing fields screened), ``rejection_by_identity``
    (a rejected action stays refused when re-worded)."""

    version: str
    rules_decide: bool
    screens: bool
    rejection_by_identity: bool


CONTROLLERS: dict[str, Controller] = {
    "controller/1": Controller("controller/1", rules_decide=False, screens=False, rejection_by_identity=False),
    "controller/2": Controller("controller/2", rules_decide=True, screens=True, rejection_by_identity=True),
}


def controller_for(bundle: dict | None) -> Controller:
    """The controller a task's artifact ``bundle`` pins (a bundle pinning none: ``controller/1``,
    what tasks filed before the field existed ran under). Raises ``KeyError`` for a version this
    build does not carry (the runner refuses such a task first: :func:`apps.agent.bundle.bundle_problem`)."""
    return CONTROLLERS[(bundle or {}).get("controller") or "controller/1"]
