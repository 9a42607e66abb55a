"""The full-text leg in two languages (DESIGN.md §9): English through PostgreSQL's ``english``
configuration, Chinese through the ``jieba`` segmenter and the ``simple`` configuration.

PostgreSQL has no Chinese parser: a run of Chinese characters is one "word" to it, so a Chinese
report matched nothing. Chinese runs are segmented into words by jieba (search mode, which also
yields the shorter words inside long ones) and indexed, and queried, as space-separated words.
"""

from __future__ import annotations

import logging
import re
import threading

_CJK_RUN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")
_lock = threading.Lock()
_ready = False

#: Chinese function words that carry no topic (the segmenter returns them as words of their own)
STOPWORDS = frozenset("的 了 和 是 在 有 我 你 他 她 它 们 这 那 就 也 都 又 还 被 把 给 让 吗 呢 吧 "
                      "啊 呀 嘛 很 太 不 没 要 会 能 可以 一下 一直 已经 什么 怎么 为什么 然后 现在 今天 昨天 "
                      "一个 这个 那个 我们 你们 他们 没有 不能 不了 好像 感觉 一些 有点 之后 之前 时候".split())


def _jieba():
    global _ready
    import jieba

    with _lock:
        if not _ready:
            jieba.setLogLevel(logging.WARNING)
            jieba.initialize()
            _ready = True
    return jieba


def cjk_words(text: str) -> list[str]:
    """The Chinese words of ``text`` (jieba search-mode segmentation of each run of CJK
    characters), stop words removed, in order, repeats kept. Empty when ``text`` has no CJK."""
    runs = _CJK_RUN.findall(text or "")
    if not runs:
        return []
    jieba = _jieba()
    words = []
    for run in runs:
        words += [w for w in jieba.cut_for_search(run) if w.strip() and w not in STOPWORDS]
    return words


def segmented(text: str) -> str:
    """``text``'s Chinese words as one space-separated string, for ``to_tsvector('simple', …)``."""
    return " ".join(cjk_words(text))


def cjk_tsquery(text: str) -> str:
    """A ``to_tsquery('simple', …)`` string OR-ing the distinct Chinese words of ``text`` ("" when
    it has none). The words are CJK characters only, so nothing in them is tsquery syntax."""
    return " | ".join(dict.fromkeys(cjk_words(text)))
