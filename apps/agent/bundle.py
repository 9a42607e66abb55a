"""The artifact bundle a task was pinned to, honoured or refused (spec §16.2, §16.11: "release pins
the whole artifact bundle"): a task runs with the prompt template, parser, controller, tool schemas
and model output parser it was pinned to when this build carries them, and is refused explicitly —
``task.failed`` with reason ``bundle_unsupported: …`` — when it does not, never run with whatever
the code now has. (The reducer is honoured by :func:`apps.tasks.reducer.reducer_for`.)"""

from __future__ import annotations

from apps.actions.registry import TOOLS
from apps.agent.controllers import CONTROLLERS as CONTROLLER_VERSIONS
from apps.llm.drafter import PROMPT_TEMPLATES
from apps.llm.parser import PARSER_VERSION
from apps.llm.providers import OUTPUT_PARSERS as OUTPUT_PARSER_VERSIONS
from apps.tasks import reducer

#: the parser and controller versions this build carries
PARSERS = (PARSER_VERSION,)
CONTROLLERS = tuple(CONTROLLER_VERSIONS)
OUTPUT_PARSERS = tuple(OUTPUT_PARSER_VERSIONS)

#: the statuses in which a run still uses the bundle's prompt, parser, controller or tool schemas
#: (before the write is committed; a committed write is settled whatever the build)
USES_BUNDLE = frozenset({reducer.ACCEPTED, reducer.RETRIEVING, reducer.PROPOSING, reducer.VALIDATING,
                         reducer.WAITING_INPUT, reducer.WAITING_APPROVAL})


def bundle_problem(bundle: dict | None) -> str | None:
    """Why this build cannot run a task pinned to ``bundle`` (a task's ``artifact_bundle``), or
    None when it carries every part the bundle pins. A part the bundle does not pin (an older task's
    bundle) is not checked."""
    bundle = bundle or {}
    checks = (("prompt_template", PROMPT_TEMPLATES), ("parser", PARSERS), ("controller", CONTROLLERS),
              ("output_parser", OUTPUT_PARSERS))
    for part, carried in checks:
        if part in bundle and bundle[part] not in carried:
            return f"{part} {bundle[part]!r} is not in this build (it has {', '.join(carried)})"
    for tool, version in sorted((bundle.get("tool_schemas") or {}).items()):
        contract = TOOLS.get(tool)
        if contract is None or contract.version != version:
            have = contract.version if contract else "no such tool"
            return f"tool schema {tool} {version!r} is not in this build (it has {have})"
    return None
