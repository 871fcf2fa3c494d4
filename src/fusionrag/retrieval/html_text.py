"""An HTML page's main text in one streaming pass: the standard library's tokenizer, no tree.

A parsed tree (bs4) costs about 1.7 KB per element: a 16 MB page of tiny tags took 66 s and 3.2 GB,
1.5 million nested ``<div>`` 28 s and 1 GB. Text extraction needs only the stack of open elements,
so the page is read as a stream of tokens (``html.parser.HTMLParser``) with the same rules a tree walk
applied: an end tag closes the innermost open element of its name (and everything opened inside it),
an end tag with no open element of its name is ignored, void elements (``<br>``, ``<img>``) never open.
Memory is the text plus one small entry per open element; time is linear in the page.
"""

from __future__ import annotations

import re
from collections import Counter
from html.parser import HTMLParser

#: Elements that are not the page's text: their whole content is left out.
NOISE = frozenset(("script", "style", "noscript", "template", "svg", "iframe", "nav", "header", "footer", "aside",
                   "form", "button", "select", "head"))
#: Elements that start and end a paragraph break (``<pre>`` is handled on its own).
BLOCKS = frozenset(("p", "div", "li", "ul", "ol", "blockquote", "table", "tr", "td", "th", "dt", "dd", "dl",
                    "figcaption", "caption", "section", "article", "main", "hr", "address", "details", "summary"))
HEADINGS = frozenset(("h1", "h2", "h3", "h4", "h5", "h6"))
#: Elements with no content and no end tag (HTML's void elements and the obsolete ones parsers treat alike).
VOID = frozenset(("area", "base", "basefont", "bgsound", "br", "col", "command", "embed", "frame", "hr", "image",
                  "img", "input", "isindex", "keygen", "link", "menuitem", "meta", "nextid", "param", "source",
                  "spacer", "track", "wbr"))
HEADING_MARK = "\ue000"  # private use: marks a heading line in the flattened text
PRE_MARK = "\ue001"  # private use: marks a line of preformatted text (its indentation is kept)
_SPACE = re.compile(r"\s+")

# What an open element does to the text inside it.
_TEXT, _SKIP, _RAW = 0, 1, 2


class _Extractor(HTMLParser):
    """Flattens the page into lines: whitespace squeezed, ``<br>`` a newline, a break at each block's start
    and end, headings on their own line after :data:`HEADING_MARK`, ``<pre>`` lines kept after
    :data:`PRE_MARK`. The text of the first ``<main>`` and of the first ``<article>`` is kept apart too."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        # open elements: (name, mode inherited by content, region it opened or "")
        self.stack: list[tuple[str, int, str]] = []
        self.open: Counter[str] = Counter()  # open elements by name: an end tag with none open costs nothing
        self.regions: dict[str, list[str]] = {"": []}  # "" = the whole page; "main", "article", "body" when seen
        self.active: list[list[str]] = [self.regions[""]]
        self.raw: list[str] | None = None  # the heading or <pre> being collected
        self.title: list[str] | None = None  # the first <title>'s text while it is open
        self.title_depth = 0
        self.page_title: str | None = None

    # ---------------------------------------------------------------- output

    def _out(self, text: str) -> None:
        for parts in self.active:
            parts.append(text)

    def _mode(self) -> int:
        return self.stack[-1][1] if self.stack else _TEXT

    # ---------------------------------------------------------------- tokens

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        mode = self._mode()
        if tag == "title" and self.page_title is None and self.title is None:
            self.title, self.title_depth = [], len(self.stack)
        if tag in VOID:
            if tag == "br" and mode != _SKIP:
                (self.raw.append if mode == _RAW and self.raw is not None else self._out)("\n")
            elif tag == "hr" and mode == _TEXT:
                self._out("\n\n\n\n")  # a block that opens and closes at once
            return
        hidden = any(k == "hidden" or (k == "aria-hidden" and v == "true") for k, v in attrs)
        if mode == _SKIP or tag in NOISE or hidden:
            self._push((tag, _SKIP, ""))
            return
        region = ""
        if tag in ("main", "article", "body") and tag not in self.regions:
            region = tag
            self.regions[tag] = []
            self.active.append(self.regions[tag])
        if mode == _RAW:
            self._push((tag, _RAW, region))
        elif tag == "pre" or tag in HEADINGS:
            self.raw = []
            self._push((tag, _RAW, region))
        else:
            if tag in BLOCKS:
                self._out("\n\n")
            self._push((tag, _TEXT, region))

    def _push(self, entry: tuple[str, int, str]) -> None:
        self.stack.append(entry)
        self.open[entry[0]] += 1

    def _pop(self) -> tuple[str, int, str]:
        entry = self.stack.pop()
        self.open[entry[0]] -= 1
        return entry

    def handle_endtag(self, tag: str) -> None:
        if not self.open[tag]:  # no open element of its name: ignored at once (a scan per stray tag was quadratic)
            return
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                while len(self.stack) > i:
                    self._close(*self._pop())
                return

    def _close(self, tag: str, mode: int, region: str) -> None:
        if mode == _RAW and self._mode() != _RAW and self.raw is not None:  # the heading or <pre> itself
            raw, self.raw = "".join(self.raw), None
            if tag == "pre":  # code and aligned text: every line keeps its leading whitespace
                lines = raw.replace("\r", "").strip("\n").split("\n")
                self._out("\n\n" + "\n".join(PRE_MARK + line for line in lines) + "\n\n")
            else:
                self._out(f"\n{HEADING_MARK}{' '.join(raw.split())}\n")
        elif mode == _TEXT and tag in BLOCKS:
            self._out("\n\n")
        if region:  # by identity: two regions with the same text are equal lists
            self.active = [parts for parts in self.active if parts is not self.regions[region]]
        if self.title is not None and len(self.stack) == self.title_depth:  # the first <title> closed
            self.page_title, self.title = " ".join(self.title), None

    def handle_data(self, data: str) -> None:
        if self.title is not None and not (self.stack and self.stack[-1][0] in ("script", "style")):
            self.title.append(data)  # a script's or style's text is not the title's (as bs4's get_text)
        mode = self._mode()
        if mode == _TEXT:
            self._out(_SPACE.sub(" ", data))
        elif mode == _RAW and self.raw is not None:
            self.raw.append(data)

    def unknown_decl(self, data: str) -> None:
        if data.startswith("CDATA["):  # CDATA is text; other declarations are not
            self.handle_data(data[len("CDATA["):])

    def close(self) -> None:
        super().close()
        while self.stack:  # elements never closed end with the page
            self._close(*self._pop())
        if self.title is not None:
            self.page_title, self.title = " ".join(self.title), None


def page_text(markup: str) -> tuple[str, str]:
    """``(title, text)``: the page's first ``<title>`` (whitespace squeezed) and the flattened text of its
    first ``<main>``, else its first ``<article>``, else its ``<body>``, else the whole page."""
    parser = _Extractor()
    parser.feed(markup)
    parser.close()
    title = " ".join((parser.page_title or "").split())
    for region in ("main", "article", "body", ""):
        if region in parser.regions:
            return title, "".join(parser.regions[region])
    return title, ""
