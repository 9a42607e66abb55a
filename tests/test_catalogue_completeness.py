"""Catalogue completeness (two languages, chosen per user): no text a person reads is left in
English on a Chinese page.

Three checks, each of which fails on its own kind of gap:

1. every human-visible literal in the product's templates — text between tags and the
   ``placeholder``, ``title``, ``aria-label``, ``alt`` and ``label`` attributes — is inside a
   ``{% translate %}`` or ``{% blocktranslate %}`` (an unmarked string never reaches a catalogue);
2. the catalogue holds exactly what the templates and code mark today (a marked string added since
   the last ``make messages`` is missing from it; a removed one lingers);
3. every entry of the ``zh_Hans`` catalogue is translated, not fuzzy, and keeps the source's
   placeholders and tags (a ``%(name)s`` lost in translation is a crash or a lie at run time)."""

from __future__ import annotations

import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import polib
import pytest
from django.template.base import Lexer, TokenType

from tools.i18n import BASE_DIR, msgids

PO = BASE_DIR / "config" / "locale" / "zh_Hans" / "LC_MESSAGES" / "django.po"
TEMPLATES = sorted((BASE_DIR / "templates").rglob("*.html")) + sorted((BASE_DIR / "apps").glob("*/templates/**/*.html"))
#: literals that read the same in every language: the product's name, units, protocol words
SAME_IN_EVERY_LANGUAGE = {"faultdesk", "UTC", "JSON", "If-Match", "p50", "p95", "ms", "SQL", "HTTP", "API", "ID",
                          "OK", "CSV", "v", "s", "en"}  # "en": a locale code, the default of a document's locale
#: attributes whose literal value a person reads (and ``value`` on a button-like ``input``)
READ_ATTRIBUTES = {"placeholder", "title", "aria-label", "aria-description", "alt", "label", "hx-confirm",
                   "hx-prompt", "data-confirm"}
BUTTON_INPUTS = {"submit", "button", "reset"}
#: a quoted literal a person reads inside a template variable or tag: a filter's text argument, a
#: ``firstof`` fallback, a value passed with ``with`` (to an include or a block)
_LITERAL_IN_VAR = re.compile(r"""\|(?:default|default_if_none|yesno|pluralize)\s*:\s*(["'])(.*?)\1""")
_LITERAL_IN_TAG = re.compile(r"""(?:^firstof\b.*?|\bwith\b.*?\w+=)(["'])(.*?)\1""")
HOLE = "\x01"  # where a template variable, tag or translated text was


def _untranslated_source(path: Path) -> str:
    """``path``'s source with every template tag and variable, every translated region, every
    comment and verbatim block replaced by :data:`HOLE`: what is left is the literal markup and
    text the template sends as it is. A literal a person reads inside a variable or tag (see
    :data:`_LITERAL_IN_VAR`) is kept, as text beside the hole."""
    out, skip_until = [], None
    for token in Lexer(path.read_text(encoding="utf-8")).tokenize():
        if token.token_type == TokenType.BLOCK:
            words = token.contents.split()
            name = words[0] if words else ""
            if skip_until:
                if name == skip_until:
                    skip_until = None
                continue
            if name in ("blocktranslate", "blocktrans"):
                skip_until = "endblocktranslate" if name == "blocktranslate" else "endblocktrans"
            elif name in ("comment", "verbatim"):
                skip_until = "end" + name
            out.append(HOLE)
            if name not in ("translate", "trans", "blocktranslate", "blocktrans", "url", "load", "extends"):
                out += [HOLE + m.group(2) + HOLE for m in _LITERAL_IN_TAG.finditer(token.contents)]
        elif skip_until:
            continue
        elif token.token_type == TokenType.TEXT:
            out.append(token.contents)
        elif token.token_type == TokenType.VAR:
            out.append(HOLE)
            out += [HOLE + m.group(2) + HOLE for m in _LITERAL_IN_VAR.finditer(token.contents)]
        else:  # a {# comment #}
            out.append(HOLE)
    return "".join(out)


class _ReadText(HTMLParser):
    """The text nodes (outside ``script`` and ``style``) and read attributes of an HTML source."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []
        self._hidden = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._hidden += 1
        self.found += [value for name, value in attrs if name in READ_ATTRIBUTES and value]
        if tag == "input" and (dict(attrs).get("type") or "").lower() in BUTTON_INPUTS and dict(attrs).get("value"):
            self.found.append(dict(attrs)["value"])

    def handle_endtag(self, tag):
        if tag in ("script", "style") and self._hidden:
            self._hidden -= 1

    def handle_data(self, data):
        if not self._hidden:
            self.found.append(data)


def _english_words(text: str) -> list[str]:
    words = re.findall(r"[A-Za-z][A-Za-z'’-]*", text.replace(HOLE, " "))
    return [w for w in words if w not in SAME_IN_EVERY_LANGUAGE]


def test_every_template_literal_a_person_reads_is_marked_for_translation():
    assert TEMPLATES, "no templates found"
    unmarked = {}
    for path in TEMPLATES:
        reader = _ReadText()
        reader.feed(_untranslated_source(path))
        bits = [" ".join(piece.replace(HOLE, "…").split()) for piece in reader.found if _english_words(piece)]
        if bits:
            unmarked[str(path.relative_to(BASE_DIR))] = bits
    assert not unmarked, f"text left out of {{% translate %}}: {unmarked}"


def test_the_check_finds_an_unmarked_string_and_passes_a_marked_one(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text('{% load i18n %}<p title="Hover me">{% translate "Fine" %} Not fine {{ x }}</p>'
                   '<input type="submit" value="Send now"><button hx-confirm="Really delete?">{{ y }}</button>'
                   '{{ z|default:"not set" }}{{ n|pluralize:"y,ies" }}{% firstof a "Nothing yet" %}'
                   '{% include "x.html" with label="Go on" %}')
    good = tmp_path / "good.html"
    good.write_text('{% load i18n %}<p title="{% translate "Hover" %}">{% blocktranslate trimmed with n=x %}'
                    'Fine {{ n }} here{% endblocktranslate %} {{ x|date:"Y-m-d" }} faultdesk</p>'
                    '<input type="hidden" name="next" value="somewhere"><input type="text" value="typed">'
                    '{% url "task-detail" t.id %}{{ z|default:"—" }}')
    found = []
    for path in (bad, good):
        reader = _ReadText()
        reader.feed(_untranslated_source(path))
        found.append([" ".join(piece.replace(HOLE, " ").split()) for piece in reader.found if _english_words(piece)])
    flagged = " | ".join(found[0])
    for text in ("Hover me", "Not fine", "Send now", "Really delete?", "not set", "y,ies", "Nothing yet", "Go on"):
        assert text in flagged, text
    assert found[1] == []


def _product_sources() -> list[str]:
    paths = list(TEMPLATES)
    paths += [p for p in (BASE_DIR / "apps").rglob("*.py") if "tests" not in p.parts and "migrations" not in p.parts]
    paths += list((BASE_DIR / "config").rglob("*.py"))
    return [str(p.relative_to(BASE_DIR)) for p in paths]


def test_the_catalogue_holds_exactly_what_the_code_marks_today():
    if shutil.which("xgettext") is None:
        pytest.fail("GNU gettext's xgettext is needed to read the marked strings (Debian: apt-get install gettext)")
    marked = set(msgids(_product_sources()))
    catalogue = {entry.msgid for entry in polib.pofile(str(PO)) if not entry.obsolete}
    assert marked, "no marked strings found"
    missing, stale = sorted(marked - catalogue), sorted(catalogue - marked)
    assert not missing, f"marked but not in the catalogue (run make messages): {missing}"
    assert not stale, f"in the catalogue but marked nowhere (run make messages): {stale}"


_PLACEHOLDER = re.compile(r"%\([A-Za-z_][A-Za-z0-9_]*\)[sd]|%[sd]|</?[a-z]+[^>]*>")


def test_every_chinese_entry_is_translated_and_keeps_its_placeholders_and_tags():
    catalogue = polib.pofile(str(PO))
    assert catalogue.metadata.get("Plural-Forms", "").startswith("nplurals=1;")
    problems = []
    for entry in catalogue:
        if entry.obsolete:
            continue
        translations = list(entry.msgstr_plural.values()) if entry.msgid_plural else [entry.msgstr]
        if "fuzzy" in entry.flags or not all(t.strip() for t in translations):
            problems.append(("untranslated", entry.msgid))
            continue
        want = sorted(_PLACEHOLDER.findall(entry.msgid))
        for text in translations:
            got = sorted(_PLACEHOLDER.findall(text))
            plural_ok = entry.msgid_plural and sorted(_PLACEHOLDER.findall(entry.msgid_plural)) == got
            if got != want and not plural_ok:
                problems.append(("placeholders or tags differ", entry.msgid, text))
    assert not problems, problems
