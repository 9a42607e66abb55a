"""The attachment content checks (apps/attachments/content.py): the type comes from the bytes; a
name or declared type that disagrees lies; a name with a path is refused, not renamed."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from apps.attachments.content import Refused, inspect, log_excerpt, name_check


def _png(size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("name", ["../x.log", "a/b.png", "a\\b.png", "C:x.png", "C:\\x.png", "..", ".",
                                  "/etc/passwd", "\\\\server\\share\\x.log"])
def test_a_name_with_a_path_is_refused(name):
    with pytest.raises(Refused, match="path"):
        name_check(name)


@pytest.mark.parametrize("name", [".htaccess", "a\x00b.log", "a\u202eb.log", "", "   "])
def test_hidden_control_and_empty_names_are_refused(name):
    with pytest.raises(Refused):
        name_check(name)


def test_plain_names_in_any_script_pass():
    for name in ("printer.log", "打印机 日志.txt", "panel (2).png", "Ölwechsel.pdf"):
        assert name_check(name) == name


def test_chinese_windows_logs_and_utf16_logs_are_text():
    gb = "2026-12-05 错误 E-203 定影器温度过低\n".encode("gb18030")
    assert inspect("打印机.log", gb).kind == "text"
    u16 = "ERROR E-203 fuser\n".encode("utf-16")
    found = inspect("printer.log", u16)
    assert found.kind == "text" and "E-203" in found.text


def test_content_decides_and_the_extension_must_agree():
    assert inspect("panel.png", _png(), "image/png").content_type == "image/png"
    assert inspect("panel", _png()).content_type == "image/png"  # no extension: the content says
    with pytest.raises(Refused, match="lies"):
        inspect("panel.gif", _png())
    with pytest.raises(Refused, match="lies"):
        inspect("panel.png", _png(), "application/pdf")
    with pytest.raises(Refused):
        inspect("tool.exe", b"MZ\x90\x00" + bytes(100))
    with pytest.raises(Refused):
        inspect("page.html", b"<html><body>hi</body></html>")  # text, but not a type faultdesk takes


def test_a_decompression_bomb_is_refused_without_decoding_it(settings):
    from apps.attachments import content

    big = _png((4000, 4000))
    old = content.MAX_IMAGE_PIXELS
    content.MAX_IMAGE_PIXELS = 1_000_000
    try:
        with pytest.raises(Refused, match="pixels"):
            inspect("panel.png", big)
    finally:
        content.MAX_IMAGE_PIXELS = old


def test_the_log_excerpt_keeps_fault_lines_once_in_order_and_is_bounded():
    text = "INFO ok\nERROR E-203 fuser cold\nINFO ok\nERROR E-203 fuser cold\n打印机 卡纸 告警\n" + "x" * 5000
    assert log_excerpt(text) == "ERROR E-203 fuser cold\n打印机 卡纸 告警"
    assert log_excerpt("line one\nline two") == "line one\nline two"


@given(st.text(max_size=3000))
def test_any_text_gives_a_bounded_excerpt_without_control_characters(text):
    out = log_excerpt(text)
    assert len(out) <= 1000
    assert not any(ord(ch) < 32 and ch not in "\n\t" for ch in out)
