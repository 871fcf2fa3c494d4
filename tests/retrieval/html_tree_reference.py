"""The tree-walking HTML reader (bs4) the streaming one replaced, kept as the reference it must agree with.

It parses the page into a bs4 tree and walks it once; ~1.7 KB per element made a 16 MB page of tiny tags take
66 s and 3.2 GB. :func:`reference_page_text` returns what :func:`fusionrag.retrieval.html_text.page_text`
must return for the same markup.
"""

from __future__ import annotations

import re
from typing import Any

_HTML_NOISE = ("script", "style", "noscript", "template", "svg", "iframe", "nav", "header", "footer", "aside",
               "form", "button", "select", "head")
_HTML_BLOCKS = ("p", "div", "li", "ul", "ol", "pre", "blockquote", "table", "tr", "td", "th", "dt", "dd", "dl",
                "figcaption", "caption", "section", "article", "main", "hr", "address", "details", "summary")
_HEADINGS = ("h1", "h2", "h3", "h4", "h5", "h6")
_MARK = "\ue000"  # private use: marks a heading line in the flattened text
_PRE = "\ue001"  # private use: marks a line of preformatted text (its indentation is kept)


def reference_page_text(markup: str) -> tuple[str, str]:
    """``(title, flattened text)`` as the tree walk made them."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(markup, "html.parser")
    own = " ".join(soup.title.get_text(" ").split()) if soup.title else ""
    root = soup.find("main") or soup.find("article") or soup.body or soup
    return own, _html_text(root)


def _skipped(tag: Any) -> bool:
    """Navigation, scripts, styles and the like, and hidden elements: not the page's text."""
    return tag.name in _HTML_NOISE or tag.has_attr("hidden") or tag.get("aria-hidden") == "true"


def _walk_html(root: Any, emit: Any) -> None:
    """Depth-first over ``root`` without recursion: ``emit(node)`` for every node not under a skipped
    element; it returns False to skip the node's children, or a string to add after them."""
    from bs4 import Tag

    stack: list[tuple[Any, str | None]] = [(root, None)]
    while stack:
        node, after = stack.pop()
        if node is None:
            emit(after)
            continue
        if isinstance(node, Tag) and node is not root and _skipped(node):
            continue
        go = emit(node)
        if isinstance(node, Tag) and go is not False:
            if isinstance(go, str):
                stack.append((None, go))
            stack.extend((child, None) for child in reversed(node.contents))


def _raw_text(tag: Any) -> str:
    """A ``<pre>`` or heading's text as written (``<br>`` a newline), hidden parts left out."""
    from bs4 import CData, NavigableString, Tag

    parts: list[str] = []

    def emit(node: Any) -> Any:
        if isinstance(node, str) and not isinstance(node, NavigableString):
            return None  # a closing marker (none are used here)
        if isinstance(node, Tag):
            if node.name == "br":
                parts.append("\n")
            return None
        if type(node) in (NavigableString, CData):
            parts.append(str(node))
        return None

    _walk_html(tag, emit)
    return "".join(parts)


def _html_text(root: Any) -> str:
    """The text under ``root`` in one walk: whitespace runs squeezed, ``<br>`` a newline, a break at each
    block's start and end, headings marked on their own line, ``<pre>`` lines kept with their indentation."""
    from bs4 import CData, NavigableString, Tag

    blocks = frozenset(_HTML_BLOCKS) - {"pre"}
    headings = frozenset(_HEADINGS)
    parts: list[str] = []

    def emit(node: Any) -> Any:
        if isinstance(node, str) and not isinstance(node, NavigableString):
            parts.append(node)  # a block's closing break
            return None
        if isinstance(node, Tag):
            if node.name == "br":
                parts.append("\n")
            elif node.name == "pre":  # code and aligned text: every line keeps its leading whitespace
                lines = _raw_text(node).replace("\r", "").strip("\n").split("\n")
                parts.append("\n\n" + "\n".join(_PRE + line for line in lines) + "\n\n")
                return False
            elif node.name in headings:
                parts.append(f"\n{_MARK}{' '.join(_raw_text(node).split())}\n")
                return False
            elif node.name in blocks:
                parts.append("\n\n")
                return "\n\n"
            return None
        if type(node) in (NavigableString, CData):  # comments, doctypes and the like are not text
            parts.append(re.sub(r"\s+", " ", str(node)))
        return None

    _walk_html(root, emit)
    return "".join(parts)


