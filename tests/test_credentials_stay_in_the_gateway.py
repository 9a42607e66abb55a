"""Only the tool gateway reads a credential (spec agent-execution-system.md §16.6; ADR 0022): no module
of the product outside ``apps/gateway`` (and the settings and deploy checks under ``config/``) names
a setting or environment variable that holds one — not in code, not in a string. Docstrings may say
where a credential comes from; tests set them. Checked on the syntax tree of every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the names of every outbound credential, as settings, environment variables and their *_FILE forms
SECRET_NAME = re.compile(r"REFSERVICE_API_KEY|HELPDESK_API_TOKEN|MODEL_API_KEY|EMBEDDING_API_KEY"
                         r"|EMAIL_HOST_PASSWORD|EMAIL_HOST_USER|OTLP_HEADERS|OTLP_TRACES_HEADERS"
                         r"|imports apps\.gateway\.credentials|by a computed name")
CREDENTIALS_MODULE = "apps.gateway.credentials"


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                ids.add(id(first.value))
    return ids


def _folded(node: ast.AST) -> str | None:
    """The string a ``+`` of string constants (or an f-string's constant parts) spells, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _folded(node.left), _folded(node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return None


def _imports_credentials(node: ast.AST) -> bool:
    """Whether ``node`` imports the gateway's credentials module (or a name of it)."""
    if isinstance(node, ast.Import):
        return any(a.name == CREDENTIALS_MODULE for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.module == CREDENTIALS_MODULE or (
            node.module == "apps.gateway" and any(a.name == "credentials" for a in node.names))
    return False


def _is_constant(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) or _folded(node) is not None and not isinstance(node, ast.JoinedStr)


def _settings_like(node: ast.AST) -> bool:
    """``settings``, ``settings.FAULTDESK``, ``os.environ`` (a mapping that holds credentials)."""
    return (isinstance(node, ast.Name) and node.id in {"settings", "environ"}) or (
        isinstance(node, ast.Attribute) and node.attr in {"settings", "FAULTDESK", "environ"})


def _computed_read(node: ast.AST) -> bool:
    """Whether ``node`` reads a setting or an environment variable by a name computed at run time
    (``getattr(settings, name)``, ``settings.FAULTDESK[key]``, ``os.environ.get(key)``,
    ``os.getenv(key)``): a credential could be read so without ever being named."""
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) >= 2:
            return _settings_like(node.args[0]) and not _is_constant(node.args[1])
        if isinstance(func, ast.Attribute) and func.attr == "get" and _settings_like(func.value):
            return not _is_constant(node.args[0])
        if isinstance(func, ast.Attribute) and func.attr == "getenv" or isinstance(func, ast.Name) \
                and func.id == "getenv":
            return not _is_constant(node.args[0])
    if isinstance(node, ast.Subscript) and _settings_like(node.value):
        return not _is_constant(node.slice)
    return False


def names_of_secrets(source: str) -> list[str]:
    """Every place in ``source`` (Python) that names a credential or could reach one: a string
    (outside docstrings) or a ``+`` of strings spelling a credential's name, a name, an attribute, a
    keyword argument, an import of the gateway's credentials module."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        text = None
        if _imports_credentials(node):
            text = f"imports {CREDENTIALS_MODULE}"
        elif _computed_read(node):
            text = "reads a setting or environment variable by a computed name"
        elif isinstance(node, ast.BinOp | ast.JoinedStr):
            text = _folded(node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.keyword) and node.arg:
            text = node.arg
        if text and SECRET_NAME.search(text):
            found.append(f"line {getattr(node, 'lineno', '?')}: {text[:80]!r}")
    return found


def _product_modules():
    for path in sorted((ROOT / "apps").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if "tests" in rel.parts or "migrations" in rel.parts:
            continue
        yield rel, path.read_text(encoding="utf-8")


def test_no_product_module_outside_the_gateway_names_a_credential():
    offenders = {str(rel): hits for rel, source in _product_modules()
                 if rel.parts[:2] != ("apps", "gateway") and (hits := names_of_secrets(source))}
    assert offenders == {}, "only apps/gateway (and config/) may read a credential"


def test_the_gateway_is_where_they_are_read():
    gateway = {str(rel): names_of_secrets(source) for rel, source in _product_modules()
               if rel.parts[:2] == ("apps", "gateway")}
    assert gateway["apps/gateway/credentials.py"], "the scan found nothing where the credentials are read"


def test_the_scan_sees_every_way_code_names_one():
    for snippet in ('import os\nkey = os.environ.get("FAULTDESK_EMBEDDING_API_KEY")\n',
                    'from django.conf import settings\nkey = settings.FAULTDESK["REFSERVICE_API_KEY"]\n',
                    'from django.conf import settings\npw = settings.EMAIL_HOST_PASSWORD\n',
                    'f(HELPDESK_API_TOKEN_FILE="x")\n',
                    'key = conf[f"{prefix}MODEL_API_KEY"]\n'):
        assert names_of_secrets(snippet), snippet
    assert not names_of_secrets('"""Reads ``REFSERVICE_API_KEY`` (a docstring)."""\nx = 1\n')


def test_the_credential_scan_sees_a_read_through_the_gateways_own_module():
    """A module could reach a credential without spelling its name: through the gateway's credentials
    module, a name built by ``+``, a setting read by a computed name. The scan sees each; what other
    apps may import from the gateway (``apps.gateway.redaction``) it lets pass."""

    sidesteps = [
        'from apps.gateway import credentials\nkey = credentials.secret("model")\n',
        'from apps.gateway.credentials import authorization\nheaders = authorization("ticket.reference")\n',
        'from django.conf import settings\npw = getattr(settings, "EMAIL_HOST_" + "PASSWORD")\n',
        'from django.conf import settings\nkey = settings.FAULTDESK["MODEL_API_" + "KEY"]\n',
    ]
    sidesteps += [
        'from apps.gateway import credentials as c\nkey = c.secret("model")\n',
        'import apps.gateway.credentials\n',
        'from django.conf import settings\nname = pick()\nvalue = getattr(settings, name)\n',
        'import os\nkey = os.environ.get(name)\n',
        'import os\nkey = os.getenv(prefix + "KEY")\n',
        'from django.conf import settings\nkey = settings.FAULTDESK[name]\n',
    ]
    missed = [s for s in sidesteps if not names_of_secrets(s)]
    assert missed == [], missed
    allowed = ['from apps.gateway.redaction import redact\n',
               'from django.conf import settings\nurl = getattr(settings, "EMAIL_HOST", "")\n',
               'from django.conf import settings\nurl = settings.FAULTDESK["REFSERVICE_URL"]\n']
    assert [s for s in allowed if names_of_secrets(s)] == []
