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
                         r"|EMAIL_HOST_PASSWORD|EMAIL_HOST_USER")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                ids.add(id(first.value))
    return ids


def names_of_secrets(source: str) -> list[str]:
    """Every place in ``source`` (Python) that names a credential: a string (outside docstrings), a
    name, an attribute, a keyword argument."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
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
