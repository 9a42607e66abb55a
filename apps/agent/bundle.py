"""The artifact bundle a task was pinned to, honoured or refused (spec §16.2, §16.11: "release pins
the whole artifact bundle"): a task runs with the prompt template, parser, controller, tool schemas
and model output parser it was pinned to when this build carries them, and is refused explicitly —
``task.failed`` with reason ``bundle_unsupported: …`` — when it does not, never run with whatever
the code now has. The model provider, its structured-output form and bounds, the embedding model
and the reducer are checked the same way. (The reducer is honoured by
:func:`apps.tasks.reducer.reducer_for`; a task pinned to a reducer this build lacks cannot even
record its failure, so the runner records the refusal as a refused event and leaves the task
alone.)"""

from __future__ import annotations

from apps.actions.registry import TOOLS
from apps.agent.controllers import CONTROLLERS as CONTROLLER_VERSIONS
from apps.evidence.embedding import MINILM_MODEL, USE_MODEL
from apps.llm.drafter import PROMPT_TEMPLATES
from apps.llm.parser import PARSER_VERSION
from apps.llm.providers import OPENAI_COMPATIBLE, PROVIDERS, RESPONSE_FORMATS
from apps.llm.providers import OUTPUT_PARSERS as OUTPUT_PARSER_VERSIONS
from apps.tasks import reducer

#: the parser and controller versions this build carries
PARSERS = (PARSER_VERSION,)
CONTROLLERS = tuple(CONTROLLER_VERSIONS)
OUTPUT_PARSERS = tuple(OUTPUT_PARSER_VERSIONS)

#: the embedding models this build can embed queries with (besides ``openai:<base>#<model>``)
EMBEDDING_MODELS = (USE_MODEL, MINILM_MODEL)

#: the statuses in which a run still uses the bundle's prompt, parser, controller or tool schemas
#: (before the write is committed; a committed write is settled whatever the build)
USES_BUNDLE = frozenset({reducer.ACCEPTED, reducer.RETRIEVING, reducer.PROPOSING, reducer.VALIDATING,
                         reducer.WAITING_INPUT, reducer.WAITING_APPROVAL})


def bundle_problem(bundle: dict | None) -> str | None:
    """Why this build cannot run a task pinned to ``bundle`` (a task's ``artifact_bundle``), or
    None when it carries every part the bundle pins. A part the bundle does not pin (an older task's
    bundle) is not checked."""
    bundle = bundle or {}
    if not isinstance(bundle, dict):
        return f"the bundle must be a JSON object, not {type(bundle).__name__}"
    checks = (("prompt_template", PROMPT_TEMPLATES), ("parser", PARSERS), ("controller", CONTROLLERS),
              ("output_parser", OUTPUT_PARSERS), ("reducer", tuple(reducer.REDUCERS)),
              ("model_provider", PROVIDERS), ("response_format", RESPONSE_FORMATS))
    for part, carried in checks:
        if part in bundle and (not isinstance(bundle[part], str) or bundle[part] not in carried):
            return f"{part} {bundle[part]!r} is not in this build (it has {', '.join(carried)})"
    value = bundle.get("max_output_tokens")
    if "max_output_tokens" in bundle and (type(value) is not int or value < 1):
        return f"max_output_tokens {value!r} is not a positive whole number"
    value = bundle.get("units_per_1k_tokens")
    if "units_per_1k_tokens" in bundle and (type(value) not in (int, float) or not 0 <= value < float("inf")):
        return f"units_per_1k_tokens {value!r} is not a price (a number, 0 or more)"
    if bundle.get("model_provider") == OPENAI_COMPATIBLE:
        for part in ("model", "model_base_url"):
            if not isinstance(bundle.get(part), str) or not bundle[part]:
                return f"{part} {bundle.get(part)!r}: an OpenAI-compatible model needs it as text"
    embedding = bundle.get("embedding_model")
    if "embedding_model" in bundle and not (
            embedding in EMBEDDING_MODELS or (isinstance(embedding, str) and embedding.startswith("openai:"))):
        return (f"embedding_model {embedding!r} is not in this build "
                f"(it has {', '.join(EMBEDDING_MODELS)} and openai:<base URL>#<model>)")
    schemas = bundle.get("tool_schemas") or {}
    if not isinstance(schemas, dict):
        return f"tool_schemas must map each tool to its schema version, not {type(schemas).__name__}"
    for tool, version in sorted(schemas.items()):
        contract = TOOLS.get(tool)
        if contract is None or contract.version != version:
            have = contract.version if contract else "no such tool"
            return f"tool schema {tool} {version!r} is not in this build (it has {have})"
    return None
